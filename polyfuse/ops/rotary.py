"""Rotary position embedding on q and k together (Llama's rotate-half layout).

``cos``/``sin`` are [B, L, D] (both halves equal), usually fp32; q is [B, Hq, L, D] and k is [B, Hkv, L, D].
The native reference follows transformers' eager bf16 path: cos/sin are cast to q's dtype first.
"""

import torch

from polyfuse.core.registry import OpSpec, declare


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_native(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    cos = cos.to(q.dtype).unsqueeze(1)
    sin = sin.to(q.dtype).unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


SPEC = declare(
    OpSpec("rotary", "rotary(q[B,Hq,L,D], k[B,Hkv,L,D], cos[B,L,D], sin[B,L,D]) -> (q_rot, k_rot)", rotary_native)
)
