"""Rotary on q and k fused with the KV-cache write: the decode step's per-layer glue in one op.

Rotates q [B, Hq, L, D] and k [B, Hkv, L, D] (as ``rotary``), writes the rotated k and the unchanged v into
``k_cache`` / ``v_cache`` [B, Hkv, S, D] at the positions ``cache_position`` [L], and returns the rotated q.
Inference only: the caches are written in place.
"""

import torch

from polyfuse.core.registry import OpSpec, declare
from polyfuse.ops.rotary import rotary_native


def rotary_kv_write_native(q, k, v, cos, sin, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_position):
    q, k = rotary_native(q, k, cos, sin)
    k_cache.index_copy_(2, cache_position, k)
    v_cache.index_copy_(2, cache_position, v)
    return q


def compose(kernels):
    """The op from the run's own rotary choice plus a plain cache write (where no fused kernel is chosen)."""

    def rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, cache_position):
        q, k = kernels.rotary(q, k, cos, sin)
        k_cache.index_copy_(2, cache_position, k)
        v_cache.index_copy_(2, cache_position, v)
        return q

    return rotary_kv_write


SPEC = declare(
    OpSpec(
        "rotary_kv_write",
        "rotary_kv_write(q, k, v, cos, sin, k_cache[B,Hkv,S,D], v_cache, cache_position[L]) -> q_rot (caches written)",
        rotary_kv_write_native,
        training=False,
        compose=compose,
        composed_of=("rotary", "cache write"),
    )
)
