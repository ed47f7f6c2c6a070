"""EAGLE-3 draft heads (Li et al. 2025) on polyfuse's ops: one decoder layer drafting from the target's own hidden
states. Loaded from the published checkpoint format by ``polyfuse.models.eagle3_checkpoint.load_eagle3``.

A draft position pairs the target's residual stream at one position (three layers, low / mid / high, fused by
``fc`` from 3 x the target's hidden size) with the embedding of the token that follows it, at the rope position of
the former. The layer's q, k, v read [input_layernorm(embedding); hidden_norm(hidden)] (2 x hidden); the residual
is the hidden input; the output, before ``norm``, is the next draft position's hidden input (no ``fc`` then), and
``lm_head(norm(output))`` gives logits over the draft vocabulary, mapped to the target's by ``d2t`` (target id =
draft id + d2t[draft id]). The token embedding is the target's unless the checkpoint has its own; so is the LM head
when a checkpoint without one drafts over the whole vocabulary.

The head holds its own one-layer KV cache, laid out like the target's (generation/speculative/slots.py).
"""

from __future__ import annotations

import torch
from torch import nn

from polyfuse.checkpoint.config import head_dim
from polyfuse.models.decoder import MLP, Attention, Forward, RMSNorm, project
from polyfuse.models.projection_slice import ProjectionSlice
from polyfuse.models.rope import RotaryEmbedding
from polyfuse.ops.attention import AttentionMeta, cache_mask


class Eagle3Attention(Attention):
    """q, k, v projected from [embedding; hidden]: ``qkv_proj`` reads 2 x the hidden size."""

    def __init__(self, config, layer_idx: int = 0):
        super().__init__(config, layer_idx)
        old = self.qkv_proj
        self.qkv_proj = nn.Linear(2 * config.hidden_size, old.out_features, bias=old.bias is not None)
        q, kv = self.q_size, self.kv_size
        self.q_proj = ProjectionSlice(self, "qkv_proj", 0, q)
        self.k_proj = ProjectionSlice(self, "qkv_proj", q, q + kv)
        self.v_proj = ProjectionSlice(self, "qkv_proj", q + kv, q + 2 * kv)


class Eagle3Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Eagle3Attention(config)
        self.mlp = MLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))  # some checkpoints' variant

    def forward(self, emb, hidden, f: Forward):
        """The layer's output before the final norm [B, L, H]."""
        h = self.hidden_norm(hidden, f)
        residual = h if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb, f), h], dim=-1)
        a = self.self_attn(x, f)
        norm = self.post_attention_layernorm
        h, residual = f.ops.add_rms_norm(a, residual, norm.weight, norm.eps)
        return self.mlp(h, f) + residual


class Eagle3Head(nn.Module):
    """Built by the loader (``polyfuse.loader.load.build``) from a transformers LlamaConfig carrying the checkpoint's
    EAGLE fields: ``draft_vocab_size``, ``target_hidden_size`` (default: hidden size), ``eagle_config`` (the target
    layers), and polyfuse's ``eagle_own_embedding`` / ``eagle_own_head`` / ``eagle_fc_bias`` (what the checkpoint
    holds)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.target_hidden_size = getattr(config, "target_hidden_size", None) or hidden
        self.draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.fc = nn.Linear(3 * self.target_hidden_size, hidden, bias=bool(getattr(config, "eagle_fc_bias", False)))
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        own_head = getattr(config, "eagle_own_head", True)
        self.lm_head = nn.Linear(hidden, self.draft_vocab, bias=False) if own_head else None
        own_embedding = getattr(config, "eagle_own_embedding", False)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.int64))
        self.rotary_emb = RotaryEmbedding(config)
        self.positions = config.max_position_embeddings  # rope table length (grown to the target's by the loader)
        self.kernels = self.runtime = self.cache = self.steps = None
        self.flags: dict = {}
        self.attention_options: dict = {}
        self.name_or_path = ""
        object.__setattr__(self, "_shared", (None, None))  # the target's embedding and LM head: not submodules

    # -- built by the loader -------------------------------------------------------------------------------------

    def init_buffers(self, device) -> None:
        self.rotary_emb.init_frequencies(device)
        self.rotary_emb.ensure_length(self.positions)

    def tie_weights(self) -> None:
        pass

    def share(self, target) -> None:
        """Read the token embedding (and, without a head of its own, the LM head) from ``target``."""
        object.__setattr__(self, "_shared", (target.get_input_embeddings(), target.get_output_embeddings()))

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # -- what the speculative engine reads ------------------------------------------------------------------------

    def capture_layers(self, target_layers: int) -> tuple:
        """The target layers whose input (residual stream) the head reads: ``eagle_config``'s
        ``eagle_aux_hidden_state_layer_ids`` (layer outputs, so the next layers' inputs), else EAGLE-3's default
        inputs of layers 2, L / 2 and L - 3. A ValueError where they do not fit the target."""
        ids = (getattr(self.config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        layers = tuple(int(i) + 1 for i in ids) if ids else (2, target_layers // 2, target_layers - 3)
        if len(layers) != 3 or list(layers) != sorted(set(layers)) or not 0 <= layers[0] < layers[-1] < target_layers:
            raise ValueError(
                f"EAGLE-3 heads read the target's layers {list(layers)} (inputs), which a model of {target_layers} "
                "layers does not have"
            )
        return layers

    def hot_ids(self) -> torch.Tensor:
        """Target vocabulary id of each draft vocabulary id [draft vocab]."""
        return torch.arange(self.draft_vocab, device=self.d2t.device) + self.d2t

    def kv_cache_layout(self) -> tuple[int, int, int]:
        return 1, self.midlayer.self_attn.n_kv, head_dim(self.config)

    def prepare_positions(self, length: int) -> bool:
        return self.rotary_emb.update_length(length)

    def _meta(self, n_q: int, key_mask, cache_position, kv_len: int) -> AttentionMeta:
        meta = AttentionMeta(scale=head_dim(self.config) ** -0.5, decode=n_q == 1, **self.attention_options)
        if meta.decode:
            meta.key_mask, meta.cache_position = key_mask[:, :kv_len], cache_position
            meta.lazy_mask = lambda: cache_mask(key_mask, cache_position, kv_len, self.dtype)
            return meta
        meta.mask = cache_mask(key_mask, cache_position, kv_len, self.dtype)
        meta.valid_lengths = key_mask[:, :kv_len].sum(-1, dtype=torch.int32)
        return meta

    def draft_step(self, input_ids, position_ids, cache_position, key_mask, kv_len: int, hidden, select=None):
        """One cached step of the head over L positions: ``hidden`` [B, L, 3 x target hidden] (the target's, fused
        by ``fc``) or [B, L, H] (the head's own previous output). Returns (draft-vocabulary logits [B, Vd], the
        output before the norm [B, H]) at position ``select`` [B] of each row (default: the last)."""
        embed, shared_head = self._shared
        if self.embed_tokens is not None:
            embed = self.embed_tokens
        n = input_ids.shape[1]
        f = Forward(self.kernels, None, None, {None: self._meta(n, key_mask, cache_position, kv_len)}, self.cache,
                    cache_position, kv_len)  # fmt: skip
        f.cos, f.sin = self.rotary_emb(position_ids)
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = project(f, self.fc, hidden)
        out = self.midlayer(embed(input_ids), hidden, f)
        out = out[:, -1] if select is None else out[torch.arange(out.shape[0], device=out.device), select]
        head = self.lm_head if self.lm_head is not None else shared_head
        return project(f, head, self.norm(out, f)), out
