"""Llama on abstract ops. Every fused computation goes through ``self.kernels`` (resolved once by the registry);
the modules only hold weights and shapes. Weight names are transformers' except two fusions made at load time:
``qkv_proj`` = [q_proj; k_proj; v_proj] and ``gate_up_proj`` = [gate_proj; up_proj] (split back on save)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.utils.checkpoint
from torch import nn
from transformers.utils import ModelOutput

from polyfuse.models.llama.kv_cache import StaticKVCache
from polyfuse.models.llama.rope import RotaryEmbedding
from polyfuse.ops.attention import AttentionMeta, cache_mask


@dataclass
class CausalLMOutput(ModelOutput):
    """transformers' output convention: attribute, key and index access (``out[0]`` is the loss when present)."""

    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        bias = getattr(config, "attention_bias", False)
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)

    def forward(self, k, x, cos, sin, meta: AttentionMeta, cache: Optional[StaticKVCache], cache_position, kv_len):
        b, n, _ = x.shape
        q, key, val = k.linear(x, self.qkv_proj.weight, self.qkv_proj.bias).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q = q.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        key = key.view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        val = val.view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        if cache is None:
            q, key = k.rotary(q, key, cos, sin)
        elif k.fused("rotary_kv_write"):
            kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]
            q = k.rotary_kv_write(q, key, val, cos, sin, kc, vc, cache_position)
            key, val = kc[:, :, :kv_len], vc[:, :, :kv_len]
        else:  # unfused: the device's own rotary, then a plain cache write
            q, key = k.rotary(q, key, cos, sin)
            key, val = cache.update(self.layer_idx, key, val, cache_position, kv_len)
        out = k.attention(q, key, val, meta)
        o = self.o_proj
        return k.linear(out.transpose(1, 2).reshape(b, n, self.q_size), o.weight, o.bias)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.inter = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)

    def forward(self, k, x):
        gate_up = k.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        gate, up, down = gate_up[..., : self.inter], gate_up[..., self.inter :], self.down_proj
        if k.fused("swiglu_linear"):  # SwiGLU folded into the down projection's input
            return k.swiglu_linear(gate, up, down.weight, down.bias)
        return k.linear(k.swiglu(gate, up), down.weight, down.bias)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, k, pending, residual, cos, sin, meta, cache, cache_position, kv_len):
        """``pending`` is the previous block's output not yet added to ``residual`` (None before layer 0)."""
        norm = self.input_layernorm
        if residual is None:
            h, residual = k.rms_norm(pending, norm.weight, norm.eps), pending
        else:
            h, residual = k.add_rms_norm(pending, residual, norm.weight, norm.eps)
        h = self.self_attn(k, h, cos, sin, meta, cache, cache_position, kv_len)
        norm = self.post_attention_layernorm
        h, residual = k.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(k, h), residual


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """HF-compatible causal LM. Build with ``from_pretrained`` / ``from_config`` (polyfuse.models.llama.loading)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kernels = None  # polyfuse.backends.registry.Kernels, set by the loader
        self.runtime = None  # polyfuse.backends.runtime.DeviceRuntime, set by the loader
        self.cache: Optional[StaticKVCache] = None
        self.attention_options: dict = {}
        self.gradient_checkpointing = False

    supports_gradient_checkpointing = True

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        """transformers' API (Trainer's ``gradient_checkpointing=True`` calls it): recompute each decoder block in
        the backward instead of keeping its activations."""
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    # -- building blocks shared by forward() and generation ------------------------------------------------------

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def make_meta(self, n_q: int, key_mask: Optional[torch.Tensor], cache_position: torch.Tensor, kv_len: int, dtype):
        """One AttentionMeta per forward. key_mask [B, >=kv_len] bool marks real keys (False: left padding)."""
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        meta = AttentionMeta(
            scale=head_dim**-0.5, decode=n_q == 1 and self.cache is not None, **self.attention_options
        )
        if key_mask is None:
            meta.is_causal = True  # no padding and keys == queries: plain causal
            return meta
        if meta.decode:
            # Kernels that read key_mask + cache_position directly never build the additive mask.
            meta.key_mask, meta.cache_position = key_mask[:, :kv_len], cache_position
            meta.lazy_mask = lambda: cache_mask(key_mask, cache_position, kv_len, dtype)
            return meta
        meta.mask = cache_mask(key_mask, cache_position, kv_len, dtype)
        meta.valid_lengths = key_mask[:, :kv_len].sum(-1, dtype=torch.int32)
        return meta

    def hidden_states(self, input_ids, position_ids, meta, cache_position=None, kv_len=None) -> torch.Tensor:
        k, m = self.kernels, self.model
        cos, sin = m.rotary_emb(position_ids)
        hook = self.runtime.layer_hook() if (self.runtime is not None and not self.training) else None
        pending, residual = m.embed_tokens(input_ids), None
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in m.layers:
            if hook is not None:
                hook()
            args = (k, pending, residual, cos, sin, meta, self.cache, cache_position, kv_len)
            if checkpointing and residual is not None:
                # Activation checkpointing: keep each block's inputs, recompute its insides in the backward.
                pending, residual = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
            else:
                pending, residual = layer(*args)
        return k.add_rms_norm(pending, residual, m.norm.weight, m.norm.eps)[0]

    # -- HF-style API ------------------------------------------------------------------------------------------

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None, **unused) -> CausalLMOutput:
        """Full-sequence forward without a cache (training, scoring). With ``labels`` the loss is computed by the
        fused linear cross-entropy and the [tokens, vocab] logits are not materialized (``logits`` is None)."""
        b, n = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(n, device=input_ids.device)[None].expand(b, n)
        key_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            key_mask = attention_mask.bool()
        cache, self.cache = self.cache, None
        try:
            meta = self.make_meta(n, key_mask, torch.arange(n, device=input_ids.device), n, self.dtype)
            self.model.rotary_emb.update_length(n)
            self.model.rotary_emb.ensure_length(n)
            h = self.hidden_states(input_ids, position_ids, meta)
        finally:
            self.cache = cache
        if labels is None:
            return CausalLMOutput(logits=self.lm_head(h))
        shift_h = h[:, :-1].reshape(-1, h.shape[-1])
        shift_labels = labels[:, 1:].reshape(-1).to(h.device)
        loss = self.kernels.linear_cross_entropy(shift_h, self.lm_head.weight, shift_labels, -100, "mean")
        return CausalLMOutput(loss=loss)

    def step(self, input_ids, position_ids, cache_position, key_mask, kv_len: int) -> torch.Tensor:
        """One cached step (prefill or decode): writes the KV cache and returns the last position's logits [B, V]."""
        meta = self.make_meta(input_ids.shape[1], key_mask, cache_position, kv_len, self.dtype)
        h = self.hidden_states(input_ids, position_ids, meta, cache_position, kv_len)
        return self.kernels.linear(h[:, -1], self.lm_head.weight, self.lm_head.bias)

    def allocate_cache(self, batch: int, max_len: int) -> StaticKVCache:
        cfg = self.config
        if self.cache is None or not self.cache.fits(batch, max_len, self.dtype, self.device):
            self.cache = None  # free the old one first
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            n_kv = cfg.num_key_value_heads
            self.cache = StaticKVCache(cfg.num_hidden_layers, batch, n_kv, max_len, head_dim, self.dtype, self.device)
        return self.cache

    def generate(self, input_ids, attention_mask=None, **kwargs) -> torch.Tensor:
        from polyfuse.models.llama.generation import generate

        return generate(self, input_ids, attention_mask, **kwargs)

    def save_pretrained(self, path: str, **kwargs) -> None:
        from polyfuse.models.llama.loading import save_pretrained

        save_pretrained(self, path, **kwargs)
