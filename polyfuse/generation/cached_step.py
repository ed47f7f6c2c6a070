"""One cached model step over given positions, for engines that schedule their own steps (a serving scheduler,
speculative decoding verifying k + 1 positions) without copying generate()'s loop.

    step = CachedStep(model)                       # the decode step generate() runs: same wrapper, same graphs
    step.reserve(rows, length)                     # a KV cache and position tables for rows x length positions
    logits = step(ids, position_ids, cache_position, key_mask, kv_len, logits_to_keep=k + 1)   # [rows, k + 1, V]

The call goes through ``model.steps`` (polyfuse.generation.steps), so the runtime's graph wrapping applies as in
generate(): CUDA graphs capture one graph per (kv_len, shapes, logits_to_keep) and replay it after.
"""

from __future__ import annotations

from typing import Optional

import torch

from polyfuse.generation.steps import model_steps, prepare_cache


class CachedStep:
    """``phase``: "decode" (graphed under ``use_cuda_graphs`` / ``use_hpu_graphs``) or "prefill" (the prompt's
    wrapper: graphed on CUDA only with ``cuda_graph_prefill``, bypassed by HPU's ``limit_hpu_graphs``)."""

    def __init__(self, model, phase: str = "decode"):
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
        self.model, self.phase = model, phase

    def reserve(self, rows: int, length: int, bucket_size: int = -1) -> None:
        """A KV cache for ``rows`` sequences of up to ``length`` positions (in whole buckets of ``bucket_size``),
        position tables covering them; graphs captured on a cache or tables this reallocates are dropped. The cache
        keeps what earlier steps wrote while it fits."""
        prepare_cache(self.model, rows, length, bucket_size)

    def __call__(  # 8 parameters: the model step's own inputs, the rows of logits and the hidden states asked for
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        key_mask: Optional[torch.Tensor] = None,
        kv_len: Optional[int] = None,
        logits_to_keep: Optional[int] = None,
        hidden_layers: Optional[tuple] = None,
    ):
        """Write ``input_ids`` [rows, L] (at ``position_ids`` [rows, L]) into cache slots ``cache_position`` [L],
        attending to the first ``kv_len`` slots (default: the whole cache) where ``key_mask`` [rows, >= kv_len] is
        True (default: every slot; causality comes from the slots). Returns the last position's logits [rows, V],
        or with ``logits_to_keep`` = k the last k positions' [rows, k, V] (0: all L). ``hidden_layers``: a pair
        (those logits, the residual stream entering those layers [rows, L, layers x hidden]; core/model_protocol.py).
        Under CUDA graphs the result is the graph's output buffer, which the next replay overwrites (clone what you
        keep)."""
        cache = self.model.cache
        if cache is None:
            raise ValueError("CachedStep: no KV cache; call reserve(rows, length) first")
        kv_len = cache.max_len if kv_len is None else kv_len
        if key_mask is None and input_ids.shape[1] != kv_len:
            # Only a prompt step over slots 0..L-1 (L == kv_len) may run plainly causal without a mask.
            key_mask = torch.ones(input_ids.shape[0], kv_len, dtype=torch.bool, device=input_ids.device)
        steps = model_steps(self.model)
        step = steps.prefill if self.phase == "prefill" else steps.decode
        args = (kv_len, input_ids, position_ids, cache_position, key_mask)
        if hidden_layers:
            return step(*args, logits_to_keep, tuple(hidden_layers))
        return step(*args) if logits_to_keep is None else step(*args, logits_to_keep)
