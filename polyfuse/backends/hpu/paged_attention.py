"""Paged attention on Gaudi: each sequence's blocks gathered into [S, Hkv, W * block_size, D] (one index_select
per cache, static shapes: the engine pads sequences, queries and table widths to buckets), then Habana's FusedSDPA
with the additive mask of what each query sees, through ``fused_sdpa`` (attention.py; its decode form for one query
per sequence). This is the gathered form vllm-gaudi runs its buckets with; nothing here depends on a tensor's
value, so an HPU graph captured for a bucket replays for every batch of that bucket."""

from __future__ import annotations

import torch

from polyfuse.backends.hpu.attention import fused_sdpa
from polyfuse.ops.attention import AttentionMeta
from polyfuse.ops.paged_attention import PagedMeta, gather_blocks, visible_keys


def paged_fused_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMeta) -> torch.Tensor:
    k, v = gather_blocks(k_cache, meta.block_tables), gather_blocks(v_cache, meta.block_tables)
    s, _, n_keys, _ = k.shape
    qq = q.index_select(0, meta.q_index.reshape(-1)).view(s, -1, *q.shape[1:]).transpose(1, 2)  # [S, Hq, Q, D]
    seen = visible_keys(meta, n_keys)[:, None]
    mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~seen, torch.finfo(q.dtype).min)
    out = fused_sdpa(
        qq, k.contiguous(), v.contiguous(), AttentionMeta(scale=meta.scale, mask=mask, decode=meta.decode)
    )
    return out.transpose(1, 2).reshape(-1, *q.shape[1:]).index_select(0, meta.out_index)
