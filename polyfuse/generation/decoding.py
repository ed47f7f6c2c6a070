"""What every decoding strategy reads for one generate() call: the model, the prepared prompts, the settings and
the call's objects (sampling generator, stop strings, streamer, phase hooks and the token boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from polyfuse.generation.hooks import GenerationHooks, TokenBoundary
from polyfuse.generation.options import GenerationOptions
from polyfuse.generation.prompts import Prompts
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
