"""The prompt step: every prompt position written to the KV cache in one cached step, the last position's
logits returned (the model prunes the last layer to that row, ``prune_last_layer``)."""

from __future__ import annotations

import torch

from polyfuse.generation.prompts import Prompts


def prompt_key_mask(prompts: Prompts, out: torch.Tensor) -> torch.Tensor:
    """``out`` [rows, cache length] filled: the prompts' mask (False at left padding), then every later slot real."""
    out[:, : prompts.n] = prompts.mask
    out[:, prompts.n :] = True
    return out


def prefill(step, prompts: Prompts, position_ids: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """Run the runtime-wrapped prompt ``step`` (polyfuse.generation.steps); logits [rows, V]."""
    n = prompts.n
    cache_position = torch.arange(n, device=prompts.input_ids.device)
    # Without padding the prompt needs no mask: attention runs plainly causal (SDPA's flash path).
    return step(n, prompts.input_ids, position_ids, cache_position, key_mask if prompts.padded else None)
