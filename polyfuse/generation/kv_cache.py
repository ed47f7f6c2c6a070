"""Static, preallocated key/value cache: [B, Hkv, S, D] per layer, written in place at the given positions."""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.batch, self.max_len, self.dtype, self.device = batch, max_len, dtype, torch.device(device)
        self.token_state = None  # the in-place greedy step's buffers for this cache (generation/generate.py)

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
