"""CUDA graphs for inference: capture a whole step once per input signature and replay it.

``GraphedStep(fn)`` turns any inference-mode callable ``fn(kv_len: int, *tensors) -> tensor`` into one that copies
its tensor arguments into static buffers and replays a graph captured for that (kv_len, shapes, dtypes) key.
``GraphedStep(fn, inplace=True)`` is for steps that update their arguments in place (generation's ``TokenStep``):
the arguments themselves are the graph's buffers, so a replay copies nothing, and their addresses are part of the
key (new tensors: a new capture). Non-tensor arguments are constants of the graph, part of the key too.
``torch.cuda.make_graphed_callables`` is built for training (autograd); this is the inference counterpart.
If capture fails the step runs eagerly from then on, after one warning.
"""

from __future__ import annotations

import gc
import logging
import time

import torch


logger = logging.getLogger("polyfuse")


class GraphedStep:
    def __init__(self, fn, warmup: int = 2, max_graphs: int = 64, inplace: bool = False):
        self.fn = fn
        self.warmup = warmup
        self.max_graphs = max_graphs
        self.inplace = inplace
        self.graphs: dict = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.disabled_reason = None

    def reset(self) -> None:
        """Forget every graph (call when the buffers they captured, e.g. the KV cache, are reallocated)."""
        self.graphs.clear()
        self.pool = None

    def _key(self, kv_len, args):
        def signature(a):
            if not isinstance(a, torch.Tensor):
                return a
            sig = (tuple(a.shape), a.dtype, a.device)
            return sig + (a.data_ptr(),) if self.inplace else sig

        return (kv_len,) + tuple(signature(a) for a in args)

    def __call__(self, kv_len: int, *args):
        if self.disabled_reason is not None:
            return self.fn(kv_len, *args)
        key = self._key(kv_len, args)
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= self.max_graphs:
                logger.warning(
                    "polyfuse: %d CUDA graphs captured; clearing them to capture a new shape", len(self.graphs)
                )
                self.reset()
            try:
                entry = self._capture(kv_len, args)
            except Exception as e:  # capture is best effort: never a wrong or failed generation because of it
                self.disabled_reason = f"{type(e).__name__}: {e}".splitlines()[0]
                logger.warning("polyfuse: CUDA graph capture failed (%s); running steps eagerly", self.disabled_reason)
                torch.cuda.synchronize()
                return self.fn(kv_len, *args)
            self.graphs[key] = entry
            logger.info("polyfuse: captured a CUDA graph for KV length %d, batch %d", kv_len, args[0].shape[0])
        static_in, static_out, graph = entry
        if not self.inplace:
            for buf, a in zip(static_in, args):
                if isinstance(buf, torch.Tensor):
                    buf.copy_(a, non_blocking=True)
        graph.replay()
        return static_out

    def _capture(self, kv_len, args):
        t0 = time.perf_counter()
        if self.inplace:
            # The warm-up runs really execute the step, updates included: each one is undone, so the first replay
            # starts from the caller's state. What they wrote outside the arguments is the KV cache at the step's
            # own positions, which that replay writes again before attending to them.
            static_in = args  # kept in the entry so that no other tensor takes these addresses while it lives
            saved = [(a, a.clone()) for a in args if isinstance(a, torch.Tensor)]
        else:
            static_in = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            saved = []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                try:
                    self.fn(kv_len, *static_in)
                finally:
                    for a, s in saved:
                        a.copy_(s)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # A cycle holding an old graph (a dropped proposer's steps) freed mid-capture resets it there and breaks the
        # capture; torch.cuda.graph no longer collects first by default, so no collection may run inside it.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                static_out = self.fn(kv_len, *static_in)
        finally:
            if was_enabled:
                gc.enable()
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - t0
        return static_in, static_out, graph
