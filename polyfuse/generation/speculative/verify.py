"""The target's verify step: the pending token and k drafts in one cached step over k + 1 positions, returning the
logits of all k + 1 (``model.step(..., logits_to_keep=k + 1)``) and, for EAGLE-3, the residual stream at the
proposer's layers. It is the engine's decode step (``CachedStep``): under ``--use_cuda_graphs`` one CUDA graph per
(KV length, k) is captured and replayed; under ``--use_hpu_graphs`` one HPU graph per (k, KV bucket), the shapes
static whatever a step accepts (every step verifies k + 1 positions; only a prompt-lookup step with no match in any
row verifies 1: the decode step's own shape)."""

from __future__ import annotations

import torch

from polyfuse.generation.cached_step import CachedStep


def step_positions(pos: torch.Tensor, width: int, limit: int) -> torch.Tensor:
    """Rope positions [rows, width] from each row's ``pos`` [rows], clamped below ``limit``: positions past the
    model's table only ever hold drafts beyond the length budget, whose tokens are dropped."""
    return (pos[:, None] + torch.arange(width, device=pos.device)).clamp_(max=limit - 1)


class Verifier:
    def __init__(self, model, hidden_layers: tuple = ()):
        self.step, self.layers = CachedStep(model), tuple(hidden_layers)
        self.limit = model.config.max_position_embeddings

    def __call__(self, run, drafts: torch.Tensor):
        """(logits [rows, k + 1, V], hidden [rows, k + 1, layers x H] or None) for ``drafts`` [rows, k] after each
        row's pending token."""
        ids = torch.cat([run.pending[:, None], drafts], dim=1)
        width, slots = ids.shape[1], run.slots
        pos = step_positions(run.pos, width, self.limit)
        kv_len = slots.kv_len(slots.frontier + width - 1)
        out = self.step(ids, pos, slots.positions(width), slots.key_mask, kv_len, width, self.layers or None)
        return out if self.layers else (out, None)

    def prompt(self, model, prompts, position_ids, key_mask):
        """The prompt step (the engine's prefill wrapper): (last position's logits [rows, V], hidden or None)."""
        n = prompts.n
        step = CachedStep(model, "prefill")
        mask = key_mask if prompts.padded else None
        out = step(prompts.input_ids, position_ids, torch.arange(n, device=key_mask.device), mask, n, None,
                   self.layers or None)  # fmt: skip
        return out if self.layers else (out, None)
