"""The paged KV cache's storage: per layer, keys and values as [num_blocks, block_size, kv_heads, head_dim].

Block 0 is the padding block: the block manager never hands it out, padded rows of a batch (CUDA-graph and Gaudi
buckets) write their keys there and padded block-table entries point at it, so a padded step never touches a
sequence's blocks. The tensors are allocated once, zeroed (a padded query reads finite values), and never move:
captured graphs hold them.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(self, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device):
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is the padding block), got {num_blocks}")
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        """k, v [T, kv_heads, head_dim] into the flat slots ``slots`` [T] (block * block_size + offset); returns the
        layer's (key blocks, value blocks)."""
        kc, vc = self.k[layer], self.v[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, slots, k)
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v)
        return kc, vc

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def bytes_per_block(n_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype) -> int:
    return 2 * n_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
