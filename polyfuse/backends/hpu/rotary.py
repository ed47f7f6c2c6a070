"""Rotary embedding on Gaudi: ``RotaryPosEmbeddingHelperV2`` (optimum-habana's ``FusedRoPE``).

optimum-habana calls ``FusedRoPE.apply(x, cos[None, None], sin[None, None], position_ids)`` with cos/sin tables of
shape [1, 1, S, D] and position_ids [B, L] that index them. Our op receives cos/sin already gathered per row and
position ([B, L, D]). To stay on the one call layout optimum-habana runs in production, the gathered values are
viewed as a table of B*L rows, ``cos.reshape(1, 1, B * L, D)``, and ``position_ids = arange(B * L).view(B, L)``
picks row b's L entries back out: the kernel computes ``x * table[position_ids][:, None] + rotate_half(x) * ...``,
which is exactly the native reference. cos/sin are cast to x's dtype first: Habana's ``match_data_types`` would
otherwise promote a bf16 x to fp32 when cos/sin are fp32.
"""

from __future__ import annotations

import torch

from polyfuse.backends.hpu import _habana


def _kernel():
    return _habana.require(_habana.KERNELS, "RotaryPosEmbeddingHelperV2")


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, batch: int = 0):
    """[B, L, D] gathered cos/sin -> ([1, 1, B*L, D] cos, same sin, position_ids [B, L] int64). cos/sin shared by
    the whole batch ([1, L, D], as transformers gives them for position_ids [1, L]) get position_ids expanded to
    ``batch`` rows: the kernel indexes the table per row of x."""
    b, l, d = cos.shape
    position_ids = torch.arange(b * l, device=cos.device, dtype=torch.long).view(b, l)
    if b == 1 and batch > 1:
        position_ids = position_ids.expand(batch, l)
    return cos.to(dtype).reshape(1, 1, b * l, d), sin.to(dtype).reshape(1, 1, b * l, d), position_ids


def fused_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    kernel = _kernel()
    cos_t, sin_t, position_ids = rope_tables(cos, sin, q.dtype, q.shape[0])
    return kernel.apply(q, cos_t, sin_t, position_ids), kernel.apply(k, cos_t, sin_t, position_ids)
