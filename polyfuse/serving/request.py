"""What the engine schedules: a request's sampling parameters and its sequences (one per choice, ``n`` of them)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SamplingParams:
    """One request's decoding options (OpenAI's names; ``top_k`` and ``ignore_eos`` are extensions, as in vLLM).
    ``temperature`` 0 is greedy. ``logprobs``: None, or how many top alternatives to return with each token's own
    log-probability (0: only the token's)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: Optional[int] = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One choice of a request: its prompt, what it has generated, and how much of both the cache holds."""

    request_id: str
    index: int  # the choice's index (0 .. n - 1)
    prompt: list
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_ids))
    output: list = field(default_factory=list)
    computed: int = 0  # tokens whose keys and values are in the cache
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    cached_tokens: int = 0  # prompt tokens the prefix cache gave at admission
    preemptions: int = 0
    first_token_time: Optional[float] = None
    generator: object = None  # torch.Generator for a seeded sampled request
    siblings: tuple = ()  # the request's other choices (prefilled one after the other, for the prefix cache)
    # incremental detokenization (engine.py): the text so far and the offsets of the ids it was decoded from
    text: str = ""
    sent: int = 0  # characters of ``text`` already handed out
    prefix_offset: int = 0
    read_offset: int = 0
    logprobs: list = field(default_factory=list)  # per token: (token id, logprob, [(id, logprob), ...])

    @property
    def tokens(self) -> list:
        return self.prompt + self.output

    def token_slice(self, start: int, count: int) -> list:
        """``tokens[start : start + count]`` without building the whole list (a decode's one token)."""
        n = len(self.prompt)
        if start >= n:
            return self.output[start - n : start - n + count]
        return (self.prompt + self.output)[start : start + count]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)
