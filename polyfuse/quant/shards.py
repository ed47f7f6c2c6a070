"""Tensor parallelism for packed weights: the part of each component of a quantized projection a rank holds.

Every format is row-local (ops/quant_formats.py), so a column-parallel projection's rank (q/k/v, gate/up, the LM
head's vocabulary rows) takes each component's entries of its output rows: along the component's n dim, one entry
per ``n_per`` rows (int4's packed zeros: one word per 8 columns of N). A row-parallel projection's rank (o_proj,
down_proj) takes its input columns: along the component's k dim, ``k_span`` entries per ``k_per`` columns (int4's
words one per 8 columns of K, its scales and zeros one per group; fp8_block's scales one per 128; a GGUF block's
18-34 bytes per 32, a K-quant super-block's 144 / 210 per 256). A component without that dim is read whole (a per-channel scale of a row-parallel
projection: each rank's columns keep their row's scale, so the ranks' weights are exactly the checkpoint's).

A shard boundary inside an entry (an int4 group split between two ranks, say) cannot be sliced: ``cannot_split``
says why when the model is built, on every rank alike; the load then fails with one error naming the projection.
An act-order GPTQ projection (its groups scattered over K) is not split by input columns either.

Quantizing at load (``--quant`` on a float checkpoint, or random weights) needs none of this: each rank quantizes
its own float slice. The per-channel scales of a row-parallel projection then come from the rank's own columns (as
vLLM's load-time fp8 takes them from its shard), and int4's groups start at the rank's first column.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from polyfuse.distributed.sharding import Shard
from polyfuse.ops.quant_formats import INT4_GROUP, Component, components


def _axis(comp: Component, shard: Shard) -> tuple[Optional[int], int, int]:
    """(dim of ``comp`` the shard slices or None, rows or columns per entry, entries per that many)."""
    if shard.dim == 0:
        return comp.n_dim, comp.n_per, 1
    return comp.k_dim, comp.k_per, comp.k_span


def cannot_split(fmt: str, shard: Shard, group_size: int = INT4_GROUP, act_order: bool = False) -> Optional[str]:
    """Why this rank's ``shard`` of a ``fmt`` projection cannot be cut from its packed components, or None."""
    if shard.dim == 1 and act_order:
        return "act-order GPTQ: its groups are scattered over the input columns that the ranks split"
    what = "output rows" if shard.dim == 0 else "input columns"
    for name, comp in components(fmt, 256, 256, group_size or INT4_GROUP).items():
        dim, per, _ = _axis(comp, shard)
        if dim is None or per == 1 or (shard.dim == 1 and per >= shard.size):
            continue  # (one entry over all of K, as a per-channel GPTQ's one group: every rank takes it whole)
        for i, (start, stop) in enumerate(shard.blocks):
            ends = stop == shard.size and i == len(shard.blocks) - 1  # a last partial group / block is whole here
            if start % per or (stop % per and not ends):
                return (f"its {name} holds one entry per {per} {what}, and this rank's {what} {start}..{stop} "
                        f"(of {shard.size}) split one")  # fmt: skip
    return None


def take(name: str, value: torch.Tensor, comp: Component, shard: Shard, group_size: int) -> torch.Tensor:
    """This rank's part of component ``name`` (``value``: the whole projection's, in the format's shape for it)."""
    dim, per, span = _axis(comp, shard)
    if dim is None:
        return value
    if name == "g_idx":  # k by k; in-order groups only (cannot_split): the rank's columns count from group 0
        total = sum(stop - start for start, stop in shard.blocks)
        return torch.arange(total, dtype=value.dtype, device=value.device) // group_size
    raw = value.view(torch.uint8) if value.element_size() == 1 else value  # torch 2.7's CPU cat has no float8
    pieces = []
    for start, stop in shard.blocks:
        first, last = start // per * span, math.ceil(stop / per) * span
        pieces.append(raw.narrow(dim, first, last - first))
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)).view(value.dtype)
