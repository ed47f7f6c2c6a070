"""Attention over a paged KV cache: each sequence's keys and values live in fixed-size blocks found through its row
of a block table (polyfuse/serving: the server's continuous batching).

q [T, Hq, D] (this call's query tokens, flattened over sequences); k_cache, v_cache [num_blocks, block_size, Hkv, D]
(one layer's blocks, already holding this step's keys and values); returns [T, Hq, D]. ``PagedMeta`` says where
each query's keys are:

  * ``block_tables`` int32 [S, W]: block ids of sequence s (position p lives in block ``block_tables[s, p //
    block_size]`` at offset ``p % block_size``); entries past a sequence's blocks are any valid block (0);
  * ``seq_lens`` int32 [S]: keys of sequence s after this step (earlier tokens plus the ones this step writes);
  * ``q_index`` int64 [S, Q]: the row of q holding the i-th query of sequence s (padding: any row);
  * ``q_pos`` int64 [S, Q]: that query's position (it sees keys 0..q_pos; padding: 0);
  * ``out_index`` int64 [T]: for each row of q, its place in the flattened [S, Q] grid;
  * ``decode``: every sequence has exactly one query, row s (Q == 1): what the one-query kernels take;
  * ``window``: sliding-window attention (keys ``q_pos - window < j <= q_pos``); ``scale`` as ``attention``.

A decode step and a chunked prefill are the same op: the prefill's queries sit at the end of their sequence's keys
(cached prefix blocks, earlier chunks, then the chunk itself, causally). Every index is built on the host by the
engine, so shapes are static per batch (Gaudi's buckets, CUDA graphs) and nothing here syncs. The native reference
gathers each sequence's blocks into [S, W * block_size] keys and runs the eager attention (fp32 softmax) on them.
Its fused implementations run by default (no run flag gates them: serving has no eager attention to compare with;
``--ops -paged_attention`` forces the reference).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from polyfuse.core.registry import OpSpec, declare
from polyfuse.ops.attention import AttentionMeta, attention_native


@dataclass
class PagedMeta:
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    q_index: torch.Tensor
    q_pos: torch.Tensor
    out_index: torch.Tensor
    scale: float
    decode: bool = False
    window: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        return self.out_index.shape[0]

    def with_window(self, window: Optional[int]) -> "PagedMeta":
        return self if window == self.window else replace(self, window=window)

    @classmethod
    def for_decode(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> "PagedMeta":
        """One query per sequence (row s, at position seq_lens[s] - 1), its indices made on the device from the
        tensors given, so a captured graph computes them from its own buffers."""
        rows = torch.arange(block_tables.shape[0], device=block_tables.device)
        pos = (seq_lens.long() - 1)[:, None]
        return cls(block_tables, seq_lens, rows[:, None], pos, rows, scale, decode=True)


def visible_keys(meta: PagedMeta, n_keys: int) -> torch.Tensor:
    """bool [S, Q, n_keys]: key j of sequence s visible to its i-th query."""
    keys = torch.arange(n_keys, device=meta.q_pos.device)
    pos = meta.q_pos[:, :, None]
    seen = keys <= pos
    if meta.window is not None:
        seen &= keys > pos - meta.window
    return seen


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[S, Hkv, W * block_size, D]: each sequence's blocks side by side (the layout ``attention`` takes)."""
    s, w = block_tables.shape
    _, bs, hkv, d = cache.shape
    return cache.index_select(0, block_tables.reshape(-1).long()).view(s, w * bs, hkv, d).transpose(1, 2)


def paged_attention_native(q, k_cache, v_cache, meta: PagedMeta) -> torch.Tensor:
    k, v = gather_blocks(k_cache, meta.block_tables), gather_blocks(v_cache, meta.block_tables)
    s, _, n_keys, _ = k.shape
    qq = q.index_select(0, meta.q_index.reshape(-1)).view(s, -1, *q.shape[1:]).transpose(1, 2)  # [S, Hq, Q, D]
    seen = visible_keys(meta, n_keys)[:, None]
    mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~seen, torch.finfo(q.dtype).min)
    out = attention_native(qq, k, v, AttentionMeta(scale=meta.scale, mask=mask))
    return out.transpose(1, 2).reshape(-1, *q.shape[1:]).index_select(0, meta.out_index)


SPEC = declare(
    OpSpec(
        "paged_attention",
        "paged_attention(q[T,Hq,D], k_cache[N,block,Hkv,D], v_cache[N,block,Hkv,D], meta: PagedMeta) -> out[T,Hq,D]",
        paged_attention_native,
        training=False,
    )
)
