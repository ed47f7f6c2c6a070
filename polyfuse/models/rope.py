"""Rotary frequencies for every rope type transformers knows (default, linear, dynamic, llama3, yarn, ...).

The inverse frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` so scaling matches HF exactly;
cos/sin are computed per forward in fp32 from the positions, once for all layers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from polyfuse.checkpoint.config import head_dim
from polyfuse.compat import rope_parameters


def _default_inv_freq(config, device=None):
    params = rope_parameters(config)  # transformers 5's rope_parameters, or 4.x's rope_theta + rope_scaling
    base = params["rope_theta"]
    dim = head_dim(config)
    partial = params.get("partial_rotary_factor", 1.0)
    dim = int(dim * partial)
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    return inv, 1.0


def check_rope_type(config) -> str:
    """The config's rope type, or a one-line ValueError naming the known ones (transformers' own models raise a
    bare KeyError for an unknown type when they are built)."""
    rope_type = rope_parameters(config).get("rope_type", "default")
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        known = sorted({"default", *ROPE_INIT_FUNCTIONS})
        raise ValueError(f"rope type {rope_type!r} is not supported (known: {', '.join(known)})")
    return rope_type


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_type = check_rope_type(config)
        self.original_max = config.max_position_embeddings
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        self.attention_scaling = 1.0
        self.cached_len = self.original_max

    def init_frequencies(self, device, seq_len: int | None = None) -> None:
        """(Re)compute inv_freq in fp32 on ``device``; called after the model is materialized."""
        if self.rope_type == "default":
            inv, scale = _default_inv_freq(self.config, device)
        elif self.rope_type == "dynamic" and seq_len is not None:
            inv, scale = ROPE_INIT_FUNCTIONS["dynamic"](self.config, device, seq_len=seq_len)
        else:
            inv, scale = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, device)
        self.inv_freq = inv.to(device=device, dtype=torch.float32)
        self.attention_scaling = scale
        # cos/sin of every position, computed with the same fp32 ops as the per-forward formula (so bit-identical):
        # a decode step then gathers two rows instead of launching a handful of elementwise kernels.
        n = self.config.max_position_embeddings if seq_len is None else max(seq_len, self.original_max)
        freqs = torch.arange(n, device=device, dtype=torch.int64).float()[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_table = emb.cos() * scale
        self.sin_table = emb.sin() * scale

    def update_length(self, seq_len: int) -> bool:
        """Dynamic NTK scaling grows the base past the trained length, as transformers does per forward. True when
        the tables were rebuilt."""
        if self.rope_type != "dynamic":
            return False
        if seq_len > self.cached_len or (seq_len <= self.original_max < self.cached_len):
            self.init_frequencies(self.inv_freq.device, seq_len=max(seq_len, self.original_max))
            self.cached_len = max(seq_len, self.original_max)
            return True
        return False

    def ensure_length(self, seq_len: int) -> None:
        """Grow the cos/sin tables for sequences past the configured positions (training on longer data)."""
        if seq_len > self.cos_table.shape[0]:
            if self.rope_type == "dynamic":
                self.update_length(seq_len)
            else:
                self.init_frequencies(self.inv_freq.device, seq_len=seq_len)

    def forward(self, position_ids: torch.Tensor):
        """position_ids [B, L] -> cos, sin [B, L, D] in fp32 (rows of the precomputed tables)."""
        return self.cos_table[position_ids], self.sin_table[position_ids]
