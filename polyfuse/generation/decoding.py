"""What every decoding strategy reads for one generate() call: the model, the prepared prompts, the settings and
the call's objects (sampling generator, stop strings, streamer, phase hooks and the token boundary, transformers'
logits processors, stopping criteria and per-step record)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from polyfuse.generation.hooks import GenerationHooks, TokenBoundary
from polyfuse.generation.options import GenerationOptions
from polyfuse.generation.prompts import Prompts
from polyfuse.generation.step_hooks import StepProcessors, StepRecord
from polyfuse.generation.stopping import StopStrings


@dataclass
class Decoding:
    model: object  # core/model_protocol.py CausalLM
    prompts: Prompts
    options: GenerationOptions
    generator: Optional[torch.Generator] = None
    stop: Optional[StopStrings] = None  # the stop strings' check, None without them
    streamer: Optional[object] = None  # transformers' BaseStreamer protocol: put(ids), end()
    hooks: Optional[GenerationHooks] = None
    processors: Optional[StepProcessors] = None  # transformers' logits processors on each step (step_hooks.py)
    criteria: Optional[Callable] = None  # the caller's stopping criteria: (input_ids, scores) -> bool [rows]
    record: Optional[StepRecord] = None  # per-step scores / logits for return_dict_in_generate
    beam_outputs: Optional[tuple] = None  # beam search: (sequences_scores, beam_indices) of the returned rows
    boundary: TokenBoundary = field(init=False)

    def __post_init__(self):
        self.boundary = TokenBoundary(self.model.runtime, self.hooks)

    def start(self) -> None:
        """Just before the first model step (the phase hooks' start)."""
        if self.hooks is not None:
            self.hooks.start()

    def result(self, new: torch.Tensor) -> torch.Tensor:
        """The prompts followed by the new tokens [rows, steps]."""
        return torch.cat([self.prompts.input_ids, new.to(self.prompts.input_ids.dtype)], dim=1)
