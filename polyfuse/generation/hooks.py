"""Phase boundaries of one generate() call, for observers outside the engine (the CLI's Stats, benchmarks).

``generate(..., hooks=obj)`` calls ``obj.start()`` just before the first model step (the prompt), ``first_token()``
once the first new token is chosen, ``speculation(stats)`` after a speculative call (its acceptance), and
``end(new_tokens)`` when the result is complete (new positions per row).
The strategies only mark token boundaries (:class:`TokenBoundary`, the lazy-mode step boundary they need anyway);
what a boundary means to an observer is decided here. :class:`PhaseTimer` is the observer that times the phases.
"""

from __future__ import annotations

import time
from typing import Optional


class GenerationHooks:
    """The observer interface; every method is a no-op here, so an observer overrides only what it needs."""

    def start(self) -> None:
        pass

    def first_token(self) -> None:
        pass

    def end(self, new_tokens: int) -> None:
        pass

    def speculation(self, stats) -> None:
        """Once, before ``end``, when the call ran speculative decoding: its
        ``polyfuse.generation.speculative.stats.SpeculationStats``."""


class PhaseTimer(GenerationHooks):
    """Wall time of the phases, the device synchronized at each boundary: ``first_token_s`` (the prompt step and the
    first token), ``rest_s`` (every later token) and ``new_tokens``, also as the dict ``timings``."""

    def __init__(self, runtime=None):
        self.runtime = runtime
        self.t0 = self.t_first = self.t_end = None
        self.new_tokens = 0
        self.speculative = None  # SpeculationStats of a speculative call

    def _now(self) -> float:
        if self.runtime is not None:
            self.runtime.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self.t0 = self._now()

    def first_token(self) -> None:
        self.t_first = self._now()

    def end(self, new_tokens: int) -> None:
        self.t_end, self.new_tokens = self._now(), new_tokens

    def speculation(self, stats) -> None:
        self.speculative = stats

    @property
    def first_token_s(self) -> float:
        return self.t_first - self.t0

    @property
    def rest_s(self) -> float:
        return self.t_end - self.t_first

    @property
    def timings(self) -> dict:
        return dict(first_token_s=self.first_token_s, rest_s=self.rest_s, new_tokens=self.new_tokens)


class TokenBoundary:
    """``boundary(i)`` after the i-th new token is chosen: the runtime's step boundary (HPU lazy mode), and the
    first-token phase for the hooks."""

    def __init__(self, runtime, hooks: Optional[GenerationHooks] = None):
        self.runtime, self.hooks = runtime, hooks

    def __call__(self, i: int) -> None:
        self.runtime.mark_step()
        if i == 0 and self.hooks is not None:
            self.hooks.first_token()
