"""Static, preallocated key/value cache: [B, Hkv, S, D] per layer, written in place at the given positions; its
allocation on a model (``ensure_cache``) and the KV lengths a step attends to (``--bucket_size``)."""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.batch, self.max_len, self.dtype, self.device = batch, max_len, dtype, torch.device(device)
        self.token_state = None  # the in-place greedy step's buffers for this cache (generation/token_state.py)

    def fits(self, batch: int, length: int, dtype, device) -> bool:
        return self.batch == batch and self.max_len >= length and self.dtype == dtype and self.device == device

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor, kv_len: int):
        """Write k, v [B, Hkv, L, D] at ``cache_position`` [L]; return the first ``kv_len`` positions of the cache."""
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(2, cache_position, k)
        vc.index_copy_(2, cache_position, v)
        return kc[:, :, :kv_len], vc[:, :, :kv_len]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def ensure_cache(model, batch: int, max_len: int) -> bool:
    """Give ``model.cache`` room for ``batch`` x ``max_len``; True when a new cache was allocated."""
    cache = model.cache
    if cache is not None and cache.fits(batch, max_len, model.dtype, model.device):
        return False
    model.cache = None  # free the old one first
    layers, kv_heads, head_dim = model.kv_cache_layout()
    model.cache = StaticKVCache(layers, batch, kv_heads, max_len, head_dim, model.dtype, model.device)
    return True


def bucketed(length: int, bucket_size: int, limit: int) -> int:
    """Round ``length`` up to a multiple of ``bucket_size`` (no rounding when bucket_size <= 0), at most ``limit``."""
    if bucket_size <= 0:
        return length
    return min(-(-length // bucket_size) * bucket_size, max(limit, length))


def kv_len_at(position: int, bucket_size: int, max_len: int) -> int:
    """The KV length a step whose last query is at cache slot ``position`` attends to: the bucket holding it, or
    the whole cache without buckets (one static length, so one graph)."""
    return bucketed(position + 1, bucket_size, max_len) if bucket_size > 0 else max_len
