"""The engine on a thread of its own, fed from asyncio: the HTTP side submits and aborts, the thread runs steps.

Requests and aborts go through a thread-safe inbox the thread empties before every step, so the engine is only
ever touched by its thread; each step's deltas are handed to the request's asyncio queue with
``call_soon_threadsafe``. torch releases the GIL in its kernels, so the event loop keeps answering while a step
runs. The waiting queue is bounded (``max_waiting``): a submission beyond it raises :class:`QueueFull` (HTTP 429);
after ``drain()`` (SIGTERM) submissions raise :class:`Draining` (503). A step that raises fails the requests in flight
with that error and the server goes on. Metrics (metrics.py) are observed here as tokens are handed out.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Callable, Optional

from polyfuse.serving.engine import Engine
from polyfuse.serving.request import SamplingParams


logger = logging.getLogger("polyfuse")


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


class Handle:
    """One engine request as the HTTP side sees it."""

    def __init__(self, request_id: str, loop, out: asyncio.Queue, n: int, tag):
        self.request_id, self.loop, self.out, self.tag = request_id, loop, out, tag
        self.n, self.finished = n, 0
        self.submitted = time.monotonic()
        self.first: dict = {}  # choice index -> time of its first token
        self.tokens: dict = {}

    @property
    def done(self) -> bool:
        return self.finished >= self.n


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int = 256, metrics=None, idle: Optional[Callable] = None,
                 idle_every_s: float = 1.0):  # fmt: skip
        self.engine, self.max_waiting, self.metrics = engine, max_waiting, metrics
        self.idle, self.idle_every_s = idle, idle_every_s  # tensor parallelism: a heartbeat for the other ranks
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.handles: dict = {}
        self.pending = 0  # submitted, not yet in the engine's waiting queue
        self.draining = self.stopping = False
        self.recent: deque = deque()  # (time, tokens) of recent steps, for tokens/s
        self._ids = itertools.count()
        self.thread = threading.Thread(target=self._run, name="polyfuse-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self.stopping = True
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def drain(self) -> None:
        self.draining = True

    # -- the HTTP side -----------------------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self.pending + self.engine.num_waiting

    def submit(self, prompt: list, params: SamplingParams, out: asyncio.Queue, tag=None) -> Handle:
        """Queue a request; its deltas go to ``out`` as (handle, Delta) pairs, or (handle, exception)."""
        if self.draining or self.stopping:
            raise Draining("the server is shutting down")
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests); try again later")
        handle = Handle(f"req-{next(self._ids)}", asyncio.get_running_loop(), out, params.n, tag)
        self.handles[handle.request_id] = handle
        self.pending += 1
        self.inbox.put(("add", handle, prompt, params))
        self.wake.set()
        return handle

    def abort(self, handle: Handle) -> None:
        if not handle.done and handle.request_id in self.handles:
            self.inbox.put(("abort", handle))
            self.wake.set()

    # -- the engine thread -------------------------------------------------------------------------------------------
    def _deliver(self, handle: Handle, item) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.out.put_nowait, (handle, item))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _take_inbox(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, handle, prompt, params = msg
                self.pending -= 1
                try:
                    self.engine.add_request(handle.request_id, prompt, params)
                except ValueError as e:
                    self.handles.pop(handle.request_id, None)
                    self._deliver(handle, e)
            else:
                handle = msg[1]
                self.engine.abort(handle.request_id)
                if self.handles.pop(handle.request_id, None) is not None and self.metrics is not None:
                    self.metrics.aborted()

    def _run(self) -> None:
        last_idle = time.monotonic()
        while not self.stopping:
            self._take_inbox()
            if not self.engine.has_work():
                self.wake.wait(self.idle_every_s)
                self.wake.clear()
                if self.idle is not None and time.monotonic() - last_idle >= self.idle_every_s:
                    self.idle()
                    last_idle = time.monotonic()
                continue
            try:
                deltas = self.engine.step()
            except Exception as e:  # a failed step fails its requests, not the server
                logger.exception("polyfuse serve: a step failed")
                self._fail_all(e)
                continue
            last_idle = time.monotonic()
            self._hand_out(deltas)
        self._fail_all(Draining("the server shut down"))

    def _fail_all(self, error: Exception) -> None:
        for handle in list(self.handles.values()):
            self._deliver(handle, error)
        self.handles.clear()
        self.engine.abort_all()

    def _hand_out(self, deltas: list) -> None:
        now = time.monotonic()
        self.recent.append((now, sum(len(d.token_ids) for d in deltas)))  # a delta may carry several tokens
        while self.recent and now - self.recent[0][0] > 10.0:
            self.recent.popleft()
        for d in deltas:
            handle = self.handles.get(d.request_id)
            if handle is None:
                continue
            if d.index not in handle.first:
                handle.first[d.index] = now
                if self.metrics is not None:
                    self.metrics.first_token(now - handle.submitted)
            handle.tokens[d.index] = handle.tokens.get(d.index, 0) + len(d.token_ids)
            if d.finish_reason is not None:
                handle.finished += 1
                if self.metrics is not None:
                    self.metrics.finished(d.finish_reason, now - handle.submitted, now - handle.first[d.index],
                                          handle.tokens[d.index])  # fmt: skip
                if handle.done:
                    self.handles.pop(d.request_id, None)
            self._deliver(handle, d)

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self.recent) if now - t <= 10.0]
        if len(recent) < 2:
            return 0.0
        return sum(n for _, n in recent[1:]) / max(recent[-1][0] - recent[0][0], 1e-6)
