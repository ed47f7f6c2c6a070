"""The interface every proposer implements, and what it proposes.

A speculative run (loop.py) calls, per generate():

* ``reserve(rows, max_len)``: the proposer's own KV caches (a draft model's, an EAGLE-3 head's), laid out slot for
  slot like the target's, so the run's key mask and compaction (slots.py) hold for them too (``caches()``);
* ``start(run, hidden)`` after the target's prompt step and first token (``hidden``: the target's residual stream at
  ``hidden_layers`` over the prompt, or None);
* ``propose(run)`` before each verify step: k tokens, or None for none this step (the step then verifies only the
  pending token: a plain decode step);
* ``accepted(run, proposal, accepted, emitted, hidden)`` after the acceptance, before the cache slots are committed
  (``hidden``: the target's hidden states over the verified positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Proposal:
    tokens: torch.Tensor  # [rows, k] drafted ids, in the target's vocabulary
    probs: Optional[torch.Tensor] = None  # [rows, k, V] the distributions they were drawn from; None: deterministic


class Proposer:
    name = ""  # the method, as --speculative_method names it
    hidden_layers: tuple = ()  # target layers whose input the prompt and verify steps return (EAGLE-3)

    def __init__(self, k: int):
        self.k = k

    def reserve(self, rows: int, max_len: int) -> None:
        pass

    def caches(self) -> list:
        """The proposer's KV caches, compacted with the target's (slots.py)."""
        return []

    def windows(self) -> list:
        """The sliding windows of the proposer's attention (None: full)."""
        return []

    def start(self, run, hidden: Optional[torch.Tensor]) -> None:
        pass

    def propose(self, run) -> Optional[Proposal]:
        raise NotImplementedError

    def accepted(self, run, proposal: Proposal, accepted: torch.Tensor, emitted: torch.Tensor, hidden) -> None:
        pass

    def describe(self) -> str:
        return f"{self.name}, k={self.k}"
