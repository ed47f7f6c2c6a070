"""The decoder-only transformer every family shares, on abstract ops.

Every computation goes through ``f.ops`` (the registry's ``Kernels``, resolved once per build); modules hold only
weights and shapes. Weight names are transformers' except two fusions made at load time: ``qkv_proj`` =
[q_proj; k_proj; v_proj] and ``gate_up_proj`` = [gate_proj; up_proj] (split back on save). A family subclasses
:class:`DecoderForCausalLM` (and, where its layers differ, :class:`Attention`) and names its transformers config.
The engine (``polyfuse.generation`` / ``polyfuse.loader``) loads, saves and generates through the protocol in ``core/model_protocol.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.utils.checkpoint
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import ModelOutput

from polyfuse.checkpoint.config import config_from_dict, head_dim
from polyfuse.core import kernel_options
from polyfuse.core.errors import CheckpointError
from polyfuse.distributed.context import SINGLE, building, building_context
from polyfuse.distributed.sharding import Shard, TensorParallelError, check_columns, head_shard, split
from polyfuse.loader import load as loading
from polyfuse.models.hf_model import HFCausalLMBase
from polyfuse.models.peft_lora import fused_adapters, plain_lora
from polyfuse.models.projection_slice import ProjectionSlice, fused_slices_intact
from polyfuse.models.rope import RotaryEmbedding
from polyfuse.ops.attention import AttentionMeta, cache_mask
from polyfuse.quant.qlinear import QLinear, QLinearStack


@dataclass
class CausalLMOutput(ModelOutput):
    """transformers' output convention: attribute, key and index access (``out[0]`` is the loss when present)."""

    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


@dataclass
class Forward:
    """What every layer of one forward sees: the ops, rotary tables, attention metadata per window, the cache."""

    ops: Any  # polyfuse.core.Kernels
    cos: torch.Tensor
    sin: torch.Tensor
    metas: dict  # sliding window (None: full) -> AttentionMeta
    cache: Any = None  # StaticKVCache, or None for a cache-less forward
    cache_position: Optional[torch.Tensor] = None
    kv_len: Optional[int] = None
    # A cached step of several tokens: the metadata of the last query alone, by sliding window (the last layer then
    # runs attention for that query and its o / MLP on that row only: ``DecoderLayer.forward``'s ``last``)
    last_metas: Optional[dict] = None
    # Speculative decoding (EAGLE-3): the residual stream entering these layers, every position, appended in order
    capture: tuple = ()
    captured: Optional[list] = None
    # A paged step (serving): [(first row, end row, {window: PagedMeta})] per part of the token rows (prefill chunks,
    # then decodes), and the cache slot each row's keys and values go to; ``cache`` is then the paged cache.
    paged: Optional[list] = None
    slot_mapping: Optional[torch.Tensor] = None


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x, f: Forward, residual=None):
        """``rms_norm(x)``, or with ``residual`` ``add_rms_norm(x, residual)``'s normalized sum. The model's final
        norm is called as a module (a layer's norms are read inside the layer's call): hooks on it run, so FSDP2
        unshards its weight whichever group wraps it (accelerate puts it with the LM head)."""
        if residual is None:
            return f.ops.rms_norm(x, self.weight, self.eps)
        return f.ops.add_rms_norm(x, residual, self.weight, self.eps)[0]


class LMHead(nn.Linear):
    """The output projection (an ``nn.Linear``, weight ``lm_head.weight``). ``head(h)`` gives the logits;
    ``head(h, labels, kernels)`` the mean of the fused linear cross-entropy over ``labels`` (-100 ignored), the
    [tokens, vocab] logits never materialized. The loss goes through the module's call too, not a bare read of
    ``weight``, so hooks on the head (FSDP2's unshard before, reshard after) run for it."""

    def forward(self, h, labels=None, kernels=None, reduction: str = "mean"):
        if labels is None:
            return super().forward(h)
        return kernels.linear_cross_entropy(h, self.weight, labels, -100, reduction)


def project(f: Forward, layer: nn.Module, x, up=None):
    """``layer``'s projection of ``x`` (of silu(x) * up with ``up``: the MLP's down projection): the one place a
    projection is dispatched. A quantized layer (quant/qlinear.py ``QLinear``) goes to the ``linear_q`` ops with
    its packed weight (a ``QLinearStack``: each segment's rows, concatenated), a plain ``nn.Linear`` (or a
    ``ProjectionSlice`` of a fused one) to the ``linear`` ops with its weight, PEFT's plain LoRA over a plain linear
    (models/peft_lora.py) to the ``lora_linear`` op. Any other module (a PEFT layer in another state, a Linear
    subclass with a forward of its own) is called, so what it adds to the projection is kept; the down projection's
    SwiGLU is computed first."""
    if isinstance(layer, QLinear):
        qw = layer.quantized_weight()
        return f.ops.linear_q(x, qw, layer.bias) if up is None else f.ops.swiglu_linear_q(x, up, qw, layer.bias)
    if isinstance(layer, QLinearStack):  # parts packed in different formats: each segment, in row order
        y = torch.cat([project(f, q, x, up) for q in layer.segments], dim=-1)
        return y if layer.bias is None else y + layer.bias
    if not (isinstance(layer, nn.Linear) and type(layer).forward is nn.Linear.forward):
        lora = plain_lora(layer, x)
        x = x if up is None else f.ops.swiglu(x, up)
        if lora is None:
            return layer(x)
        return f.ops.lora_linear(x, lora[0].weight, lora[0].bias, (lora[1],))
    if up is None:
        return f.ops.linear(x, layer.weight, layer.bias)
    return f.ops.swiglu_linear(x, up, layer.weight, layer.bias)


def project_fused(f: Forward, fused: nn.Module, parts, x):
    """``fused``'s projection of ``x`` as one GEMM, or None when its ``parts`` (the ``ProjectionSlice`` children, in
    row order) must be projected one by one: through the ``linear`` ops while every part is a bare slice, through
    ``lora_linear`` while every wrapped part is PEFT's plain LoRA (models/peft_lora.py)."""
    if fused_slices_intact(fused, *parts):
        return project(f, fused, x)
    adapters = fused_adapters(fused, parts, x)
    return None if adapters is None else f.ops.lora_linear(x, fused.weight, fused.bias, adapters)


def normed_projection(f: Forward, norm: RMSNorm, x, residual, fused: nn.Module, parts):
    """A layer's norm of ``x`` (plus ``residual``: the previous block's output not yet added) and, where ``fused`` is
    one quantized projection whose ``parts`` are intact, that projection in the same op (``add_rms_norm_linear_q``:
    on fp8 prefill the norm's kernel writes its rows quantized; elsewhere its composite is the norm then
    ``linear_q``). Returns (normalized input or None, the projection or None, the next residual)."""
    if isinstance(fused, QLinear) and fused_slices_intact(fused, *parts):
        y, r = f.ops.add_rms_norm_linear_q(x, residual, norm.weight, norm.eps, fused.quantized_weight(), fused.bias)
        return None, y, r
    if residual is None:
        return f.ops.rms_norm(x, norm.weight, norm.eps), None, x
    h, r = f.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    return h, None, r


def layer_window(config, layer_idx: int) -> Optional[int]:
    """The sliding window of one layer: transformers' ``layer_types`` where the config has them (Qwen2/Qwen3: only
    "sliding_attention" layers), else ``sliding_window`` for every layer (Mistral); None: full attention."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is None or (types is not None and types[layer_idx] != "sliding_attention"):
        return None
    return int(window)


class Attention(nn.Module):
    qkv_bias_default = False  # Qwen2 has q/k/v biases without saying so in its config

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        # Tensor parallelism (polyfuse/distributed/sharding.py): this rank's query heads and the kv heads they read;
        # the whole layer at world size 1.
        tp = building_context()
        shard = head_shard(config.num_attention_heads, config.num_key_value_heads, tp.world_size, tp.rank)
        self.q_heads, self.kv_heads = shard.q, shard.kv
        self.group = tp.group if tp.active else None  # o_proj's partial sums are all-reduced over it
        self.n_heads, self.n_kv, self.head_dim = len(shard.q), len(shard.kv), head_dim(config)
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias or self.qkv_bias_default
        )
        # transformers' q/k/v_proj as parameter-free row slices of qkv_proj (projection_slice.py): PEFT's
        # target_modules find them by those names. Registered in transformers' module order (q, k, v, o), so PEFT
        # wraps and initializes the adapters in the same order as on transformers' Llama.
        q, kv = self.q_size, self.kv_size
        self.q_proj = ProjectionSlice(self, "qkv_proj", 0, q)
        self.k_proj = ProjectionSlice(self, "qkv_proj", q, q + kv)
        self.v_proj = ProjectionSlice(self, "qkv_proj", q + kv, q + 2 * kv)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.window = layer_window(config, layer_idx)

    def parts(self):
        return self.q_proj, self.k_proj, self.v_proj

    def heads(self, x, f: Forward, qkv=None):
        """q, k, v as [B, L, heads, D] (a family that normalizes heads extends this): one fused qkv_proj GEMM while
        q/k/v_proj are its bare slices or PEFT's plain LoRA over them (``project_fused``), else each through its own
        module. ``qkv``: that GEMM's output already made with the layer's norm (``normed_projection``; x is None)."""
        b, n = (x if qkv is None else qkv).shape[:2]
        parts = self.parts()
        if qkv is None:
            qkv = project_fused(f, self.qkv_proj, parts, x)
        if qkv is not None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = (project(f, m, x) for m in parts)
        return (
            q.view(b, n, self.n_heads, self.head_dim),
            k.view(b, n, self.n_kv, self.head_dim),
            v.view(b, n, self.n_kv, self.head_dim),
        )

    def forward(self, x, f: Forward, qkv=None, last: bool = False):
        """``last``: every position's keys and values go to the cache, but only the last query attends (its output
        [B, 1, H]; a cached step's last layer, whose other rows no logit reads)."""
        if f.paged is not None:
            return self.paged(x, f, qkv)
        b, n = (x if qkv is None else qkv).shape[:2]
        q, k, v = (t.transpose(1, 2) for t in self.heads(x, f, qkv))
        meta = f.metas[self.window]
        if f.cache is None:
            q, k = f.ops.rotary(q, k, f.cos, f.sin)
        else:
            kc, vc = f.cache.k[self.layer_idx], f.cache.v[self.layer_idx]
            q = f.ops.rotary_kv_write(q, k, v, f.cos, f.sin, kc, vc, f.cache_position)
            k, v = kc[:, :, : f.kv_len], vc[:, :, : f.kv_len]
            if last:
                q, n, meta = q[:, :, -1:], 1, f.last_metas[self.window]
        out = f.ops.attention(q, k, v, meta)
        out = project(f, self.o_proj, out.transpose(1, 2).reshape(b, n, self.q_size))
        return out if self.group is None else f.ops.all_reduce(out, self.group)  # row-parallel o_proj

    def paged(self, x, f: Forward, qkv=None):
        """A paged step's attention: the token rows are one sequence [1, T] here; rotary, the new keys and values
        written at their cache slots (``f.slot_mapping``), then ``paged_attention`` once per part of the rows."""
        n = (x if qkv is None else qkv).shape[1]
        q, k, v = self.heads(x, f, qkv)
        q, k = f.ops.rotary(q.transpose(1, 2), k.transpose(1, 2), f.cos, f.sin)
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # [T, heads, D]
        kc, vc = f.cache.write(self.layer_idx, k, v[0], f.slot_mapping)
        if len(f.paged) == 1:
            out = f.ops.paged_attention(q, kc, vc, f.paged[0][2][self.window])
        else:
            out = q.new_empty(q.shape)
            for start, end, metas in f.paged:
                out[start:end] = f.ops.paged_attention(q[start:end], kc, vc, metas[self.window])
        out = project(f, self.o_proj, out.reshape(1, n, self.q_size))
        return out if self.group is None else f.ops.all_reduce(out, self.group)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        tp = building_context()  # tensor parallelism: this rank's block of the intermediate columns
        check_columns("intermediate size", config.intermediate_size, tp.world_size)
        self.columns = split(config.intermediate_size, tp.world_size, tp.rank)
        self.group = tp.group if tp.active else None
        self.inter = len(self.columns)
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        # transformers' gate/up_proj as parameter-free row slices of gate_up_proj (see Attention), then down_proj
        self.gate_proj = ProjectionSlice(self, "gate_up_proj", 0, self.inter)
        self.up_proj = ProjectionSlice(self, "gate_up_proj", self.inter, 2 * self.inter)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)

    def parts(self):
        return self.gate_proj, self.up_proj

    def forward(self, x, f: Forward, gate_up=None):
        """``gate_up``: the fused gate/up GEMM's output already made with the layer's norm (``normed_projection``; x
        is then None)."""
        if gate_up is None:
            gate_up = project_fused(f, self.gate_up_proj, self.parts(), x)
        if gate_up is not None:
            gate, up = gate_up[..., : self.inter], gate_up[..., self.inter :]
        else:
            gate, up = project(f, self.gate_proj, x), project(f, self.up_proj, x)
        out = project(f, self.down_proj, gate, up)
        return out if self.group is None else f.ops.all_reduce(out, self.group)  # row-parallel down_proj


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, attention_cls=Attention):
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, pending, residual, f: Forward, stream: bool = False, last: bool = False):
        """``pending`` is the previous block's output not yet added to ``residual`` (None before layer 0); returns the
        pair for the next layer. ``stream=True``: ``pending`` is the whole residual stream and the next one is returned
        (``block``), the activation-checkpointing form. Both go through the module's call, so hooks on the layer
        (FSDP2's unshard/reshard) run either way. ``last`` (a cached step's last layer, ``f.last_metas`` set): the
        cache gets every position's keys and values, the rest runs on the last position only (returns [B, 1, H])."""
        if stream:
            return self.block(pending, f)
        attn, mlp = self.self_attn, self.mlp
        h, qkv, residual = normed_projection(f, self.input_layernorm, pending, residual, attn.qkv_proj, attn.parts())
        h = attn(h, f, qkv=qkv, last=last)
        if last:
            residual = residual[:, -1:]
        norm = self.post_attention_layernorm
        h, gate_up, residual = normed_projection(f, norm, h, residual, mlp.gate_up_proj, mlp.parts())
        return mlp(h, f, gate_up=gate_up), residual

    def block(self, x, f: Forward):
        """The same layer on the whole residual stream ``x`` (returns the next one): the activation-checkpointing
        form, so each checkpoint keeps one [B, L, H] tensor instead of the (pending, residual) pair of ``forward``
        (the pair halves the adds but doubles what a checkpointed model keeps per layer)."""
        norm = self.input_layernorm
        h = self.self_attn(f.ops.rms_norm(x, norm.weight, norm.eps), f)
        norm = self.post_attention_layernorm
        h, residual = f.ops.add_rms_norm(h, x, norm.weight, norm.eps)
        return residual + self.mlp(h, f)


class DecoderModel(nn.Module):
    def __init__(self, config, attention_cls=Attention):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, attention_cls) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **unused):
        """transformers' base-model call (``model.base_model(...)``, as TRL's fused LM head makes it): the final
        norm's output as ``last_hidden_state``, computed by the causal LM that holds this module (``_owner``)."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("polyfuse's models take input_ids, not inputs_embeds")
        h = self._owner.final_hidden(input_ids, attention_mask, position_ids)
        return BaseModelOutputWithPast(last_hidden_state=h)


class DecoderForCausalLM(HFCausalLMBase):
    """A transformers ``PreTrainedModel`` (models/hf_model.py has that surface). Build with ``from_pretrained`` /
    ``from_config``; a family sets the class fields."""

    config_class = None  # the family's transformers config class
    model_types: tuple = ()  # config.json model_type values this family takes
    hf_architecture = ""  # transformers' class name, written to config.json on save
    attention_cls = Attention
    supports_gradient_checkpointing = True
    # What accelerate's FSDP2 preparation reads from transformers' models: the class each ``fully_shard`` unit is
    # (TRANSFORMER_BASED_WRAP's default ``transformer_layer_cls_to_wrap``) and where the final norm lives.
    _no_split_modules = ["DecoderLayer"]
    base_model_prefix = "model"
    # A cached step of several tokens (the prefill) runs its last layer's attention for the last query and that
    # layer's o projection and MLP on the last row only: the logits read no other row (llama.cpp skips them the same
    # way). False: every row, as a cache-less forward does (tests compare the two). Set it before generating: a step
    # graph captured earlier keeps its form (a model's ``steps = None`` drops them).
    prune_last_layer = True
    # speculative_model=PATH in generate(): (model, path, method) -> the loaded heads or draft model; set by
    # polyfuse/models/eagle3_checkpoint.py, which imports this module (so not imported from here)
    speculative_loader = None

    def __init__(self, config, tp=None):
        super().__init__(config)
        # Tensor parallelism (polyfuse.distributed, docs/distributed.md): the layers read their shard from the
        # building context; the LM head is vocab-parallel (``vocab``: this rank's rows), the embedding replicated.
        self.tp = tp if tp is not None else SINGLE
        with building(self.tp):
            self.model = DecoderModel(config, self.attention_cls)
        object.__setattr__(self.model, "_owner", self)  # a plain attribute, not a submodule: no cycle
        self.vocab = None
        if self.tp.active:
            check_columns("vocabulary", config.vocab_size, self.tp.world_size)
            self.vocab = split(config.vocab_size, self.tp.world_size, self.tp.rank)
        vocab = config.vocab_size if self.vocab is None else len(self.vocab)
        self.lm_head = LMHead(config.hidden_size, vocab, bias=False)
        self.tie_weights()
        self.windows = sorted({layer.self_attn.window for layer in self.model.layers}, key=lambda w: w or 0)
        self.kernels = None  # polyfuse.core.Kernels, set by the loader
        self.runtime = None  # polyfuse.core.DeviceRuntime, set by the loader
        self.flags: dict = {}
        self.cache = None  # polyfuse.generation.kv_cache.StaticKVCache, allocated by the engine
        self.steps = None  # the generation engine's step wrappers and graphs (core/model_protocol.py)
        self.attention_options: dict = {}
        self.gradient_checkpointing = False
        self.tokenizer_source = None  # (folder, gguf file) of the tokenizer a save writes beside the weights
        self.post_init()  # transformers' bookkeeping (tied keys, ...); weights stay as built (hf_model.py)

    # -- building (core/model_protocol.py) ---------------------------------------------------------------------------

    @classmethod
    def config_for(cls, raw: dict, where: str):
        if raw.get("model_type") not in cls.model_types:
            raise CheckpointError(f"{where}: model_type {raw.get('model_type')!r} is not a {cls.__name__}")
        return config_from_dict(cls.config_class, raw, where)

    @classmethod
    def from_config(cls, config, dtype=torch.float32, device="cpu", flags=None, overrides="", training=False, seed=0,
                    quant=None, **options):  # fmt: skip
        flags = kernel_options.merge(flags, options)
        return loading.from_config(cls, config, dtype, device, flags, overrides, training, seed, quant=quant)

    def fused_projections(self) -> dict:
        attn, inter = self.model.layers[0].self_attn, self.model.layers[0].mlp.inter  # this rank's sizes under TP
        return {
            "self_attn.qkv_proj": [
                ("self_attn.q_proj", attn.q_size), ("self_attn.k_proj", attn.kv_size), ("self_attn.v_proj", attn.kv_size)
            ],
            "mlp.gate_up_proj": [("mlp.gate_proj", inter), ("mlp.up_proj", inter)],
        }  # fmt: skip

    def tp_shards(self) -> dict:
        """{transformers weight fragment: Shard}: the rows or columns of each checkpoint tensor this rank reads under
        tensor parallelism; empty at world size 1 (everything is read whole, as is anything not listed)."""
        if not self.tp.active:
            return {}
        attn, mlp, cfg = self.model.layers[0].self_attn, self.model.layers[0].mlp, self.config
        hd, n_q, n_kv, inter = attn.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
        q, kv = Shard.of(0, attn.q_heads, hd, n_q), Shard.of(0, attn.kv_heads, hd, n_kv)
        cols = ((mlp.columns.start, mlp.columns.stop),)
        return {
            "self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
            "self_attn.o_proj": Shard(1, q.blocks, q.size),
            "mlp.gate_proj": Shard(0, cols, inter), "mlp.up_proj": Shard(0, cols, inter),
            "mlp.down_proj": Shard(1, cols, inter),
            "lm_head": Shard(0, ((self.vocab.start, self.vocab.stop),), cfg.vocab_size),
        }  # fmt: skip

    def init_buffers(self, device) -> None:
        self.model.rotary_emb.init_frequencies(device)

    def tie_weights(self, *args, **kwargs) -> None:
        """Share the LM head with the embedding where the config says so (transformers' arguments unused)."""
        if self.config.tie_word_embeddings and not isinstance(self.lm_head, QLinear):
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- transformers' API ---------------------------------------------------------------------------------------

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False
    ) -> None:
        """Trainer's ``gradient_checkpointing=True`` calls it (transformers 5.x: ``activation_checkpointing_enable``,
        with ``every_n_layers`` and ``offload``): each decoder block is recomputed in the backward. Every layer, with
        its input kept on the device: other ``every_n_layers`` / ``offload`` values are refused."""
        if every_n_layers != 1 or offload:
            raise ValueError(
                f"polyfuse's decoder checkpoints every layer and keeps its input on the device (every_n_layers=1, "
                f"offload=False), not every_n_layers={every_n_layers}, offload={offload}"
            )
        self.gradient_checkpointing = True

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        self.gradient_checkpointing_enable(activation_checkpointing_kwargs, every_n_layers, offload)

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    activation_checkpointing_disable = gradient_checkpointing_disable

    @property
    def is_gradient_checkpointing(self) -> bool:
        """transformers' flag; PEFT reads it when wrapping (True: it makes the embedding output require grad, which a
        non-reentrant checkpoint, as polyfuse's, does not need)."""
        return self.gradient_checkpointing

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # -- the forward ---------------------------------------------------------------------------------------------

    def make_metas(self, n_q: int, key_mask, cache_position, kv_len: int, cached: bool) -> dict:
        """One AttentionMeta per sliding window in use. key_mask [B, >=kv_len] bool marks real keys (False: left
        padding); None means no padding (plain causal)."""
        return {w: self._meta(n_q, key_mask, cache_position, kv_len, cached, w) for w in self.windows}

    def _meta(self, n_q, key_mask, cache_position, kv_len, cached, window) -> AttentionMeta:
        scale = head_dim(self.config) ** -0.5
        meta = AttentionMeta(scale=scale, decode=n_q == 1 and cached, window=window, **self.attention_options)
        if key_mask is None:
            meta.is_causal = True  # no padding and keys == queries: plain causal
            return meta
        if meta.decode:
            # Kernels that read key_mask + cache_position directly never build the additive mask.
            meta.key_mask, meta.cache_position = key_mask[:, :kv_len], cache_position
            meta.lazy_mask = lambda: cache_mask(key_mask, cache_position, kv_len, self.dtype, window)
            return meta
        meta.mask = cache_mask(key_mask, cache_position, kv_len, self.dtype, window)
        if cached:  # the generate prefill: prompts are left-padded, so lengths describe the mask (Gaudi's causal mode)
            meta.valid_lengths = key_mask[:, :kv_len].sum(-1, dtype=torch.int32)
        return meta

    def hidden_states(self, input_ids, position_ids, f: Forward, last: int = 0, rows=None) -> torch.Tensor:
        """The final norm's output [B, L, H]; ``last`` > 0: of the last ``last`` positions only [B, last, H] (a cached
        step needs no more: the final norm then reads those rows per sequence, not the whole prompt); ``rows`` (an
        index tensor): of those positions only [B, len(rows), H] (a paged step's rows that give logits)."""
        m = self.model
        f.cos, f.sin = m.rotary_emb(position_ids)
        hook = self.runtime.layer_hook() if (self.runtime is not None and not self.training) else None
        pending, residual = m.embed_tokens(input_ids), None
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # Activation checkpointing: keep each block's input (the residual stream), recompute its insides in the
            # backward.
            x = pending
            for layer in m.layers:
                x = torch.utils.checkpoint.checkpoint(layer, x, None, f, stream=True, use_reentrant=False)
            return m.norm(x, f)
        final = len(m.layers) - 1 if (last and f.last_metas is not None) else -1
        for i, layer in enumerate(m.layers):
            if hook is not None:
                hook()
            if f.capture and i in f.capture:
                f.captured.append(pending if residual is None else pending + residual)
            pending, residual = layer(pending, residual, f, last=True) if i == final else layer(pending, residual, f)
        if last:
            pending, residual = pending[:, -last:], (residual[:, -last:] if residual is not None else None)
        elif rows is not None:
            pending = pending.index_select(1, rows)
            residual = residual.index_select(1, rows) if residual is not None else None
        return m.norm(pending, f, residual)

    def final_hidden(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """The final norm's output [B, L, H] of a full-sequence forward without a cache."""
        b, n = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(n, device=input_ids.device)[None].expand(b, n)
        key_mask = None
        # An all-ones mask runs as plain causal attention; deciding it reads the mask on the host, which a traced
        # forward cannot: under torch.compile a given mask is always applied (transformers' sdpa mask does the same).
        if attention_mask is not None and (torch.compiler.is_compiling() or not bool(attention_mask.all())):
            key_mask = attention_mask.bool()
        metas = self.make_metas(n, key_mask, torch.arange(n, device=input_ids.device), n, cached=False)
        self.model.rotary_emb.update_length(n)
        self.model.rotary_emb.ensure_length(n)
        return self.hidden_states(input_ids, position_ids, Forward(self.kernels, None, None, metas))

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None, num_items_in_batch=None,
                **unused) -> CausalLMOutput:  # fmt: skip
        """Full-sequence forward without a cache (training, scoring). With ``labels`` the loss is computed by the
        fused linear cross-entropy and the [tokens, vocab] logits are not materialized (``logits`` is None): the
        mean over the labelled tokens, or with ``num_items_in_batch`` (the Trainer's count over its accumulated
        batches) their sum divided by it, as transformers' models."""
        h = self.final_hidden(input_ids, attention_mask, position_ids)
        if labels is None:
            if self.vocab is not None:
                return CausalLMOutput(logits=self.vocab_parallel_logits(h))
            return CausalLMOutput(logits=self.head_logits(h) if isinstance(self.lm_head, QLinear) else self.lm_head(h))
        if self.vocab is not None:
            raise TensorParallelError("a tensor-parallel model computes logits, not losses (inference only)")
        shift_h = h[:, :-1].reshape(-1, h.shape[-1])
        shift_labels = labels[:, 1:].reshape(-1).to(h.device)
        reduction = "mean" if num_items_in_batch is None else "sum"
        if isinstance(self.lm_head, QLinear):  # a packed head (--quant_lm_head): float32 logits, then the plain loss
            logits = self.head_logits(shift_h.float())
            loss = torch.nn.functional.cross_entropy(logits, shift_labels, ignore_index=-100, reduction=reduction)
        else:  # the fused linear cross-entropy, through the head's call
            loss = self.lm_head(shift_h, shift_labels, self.kernels, reduction)
        if num_items_in_batch is not None:
            loss = loss / (
                num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
            )
        return CausalLMOutput(loss=loss)

    # -- the engine's side (core/model_protocol.py) -----------------------------------------------------------------

    def kv_cache_layout(self) -> tuple[int, int, int]:
        cfg = self.config
        return cfg.num_hidden_layers, self.model.layers[0].self_attn.n_kv, head_dim(cfg)  # this rank's kv heads

    def prepare_positions(self, length: int) -> bool:
        return self.model.rotary_emb.update_length(length)

    def step(self, input_ids, position_ids, cache_position, key_mask, kv_len: int, logits_to_keep=None,
             hidden_layers=None):  # fmt: skip
        n = input_ids.shape[1]
        keep = 1 if logits_to_keep is None else (n if logits_to_keep == 0 else min(logits_to_keep, n))
        metas = self.make_metas(n, key_mask, cache_position, kv_len, cached=True)
        f = Forward(self.kernels, None, None, metas, self.cache, cache_position, kv_len)
        if n > 1 and keep == 1 and self.prune_last_layer:
            f.last_metas = self.last_query_metas(input_ids.shape[0], key_mask, cache_position, kv_len)
        if hidden_layers:
            f.capture, f.captured = self.capture_layers(hidden_layers), []
        h = self.hidden_states(input_ids, position_ids, f, last=keep)
        if logits_to_keep is None:
            h = h[:, -1]
        logits = self.vocab_parallel_logits(h) if self.vocab is not None else self.head_logits(h)
        return logits if not hidden_layers else (logits, torch.cat(f.captured, dim=-1))

    def capture_layers(self, layers) -> tuple:
        """``hidden_layers`` of a step checked: indices of decoder layers whose input (the residual stream) is kept;
        a ValueError for one outside the model."""
        layers = tuple(int(i) for i in layers)
        count = len(self.model.layers)
        if any(not 0 <= i < count for i in layers) or list(layers) != sorted(set(layers)):
            raise ValueError(f"hidden_layers {list(layers)}: increasing indices of this model's {count} layers")
        return layers

    def paged_step(self, cache, input_ids, positions, slot_mapping, parts, logits_rows) -> torch.Tensor:
        """One serving step over a paged KV cache (polyfuse/serving): ``input_ids``, ``positions``, ``slot_mapping``
        [T] (the rows of every scheduled sequence, flattened: prefill chunks, then one row per decode), ``parts``
        [(first row, end row, PagedMeta)] covering the rows in order, ``logits_rows`` [S] the rows whose next-token
        logits are wanted. Writes each row's keys and values into ``cache`` (``write(layer, k, v, slots)``, returning
        the layer's block tensors) and returns the logits [S, vocab]."""
        paged = [(a, b, {w: meta.with_window(w) for w in self.windows}) for a, b, meta in parts]
        f = Forward(self.kernels, None, None, {}, cache, paged=paged, slot_mapping=slot_mapping)
        h = self.hidden_states(input_ids[None], positions[None], f, rows=logits_rows)[0]
        if self.vocab is not None:
            return self.vocab_parallel_logits(h)
        return self.head_logits(h)

    def last_query_metas(self, batch: int, key_mask, cache_position, kv_len: int) -> dict:
        """The attention metadata of a step's last query alone, by sliding window: a one-query step at the last
        cache slot (what a decode step passes), over every key of the cache up to ``kv_len``; no ``key_mask`` (no
        padding) marks every key real. Prompts are left-padded, so the last position is real in every row."""
        if key_mask is None:
            key_mask = torch.ones(batch, kv_len, dtype=torch.bool, device=cache_position.device)
        return {w: self._meta(1, key_mask, cache_position[-1:], kv_len, True, w) for w in self.windows}

    def compile_decoder(self, compile_fn, regional: bool = False) -> None:
        """--torch_compile's regions (optimum-habana's ``get_torch_compiled_model``): the whole decoder, embedding to
        final norm (``hidden_states``, which every step and the cache-less forward run), or with ``regional`` each
        decoder layer (its ``compile_regions``). ``compile_fn(fn)`` returns the compiled callable; None only drops
        what an earlier call compiled (the loader calls it whenever the kernels are set again)."""
        self.__dict__.pop("hidden_states", None)
        for layer in self.model.layers:
            layer.__dict__.pop("forward", None)
        if compile_fn is None:
            return
        if regional:
            for layer in self.model.layers:
                layer.forward = compile_fn(layer.forward)
        else:
            self.hidden_states = compile_fn(self.hidden_states)

    def head_logits(self, h) -> torch.Tensor:
        """The LM head on ``h``: the ``linear`` ops, or ``linear_q`` where the head is packed (--quant_lm_head)."""
        head = self.lm_head
        if isinstance(head, QLinear):
            return self.kernels.linear_q(h, head.quantized_weight(), head.bias)
        return self.kernels.linear(h, head.weight, head.bias)

    def vocab_parallel_logits(self, h) -> torch.Tensor:
        """Tensor parallelism: the logits of this rank's vocabulary rows, zero-padded to the whole vocabulary and
        summed over the ranks (the ``all_reduce`` op), so every rank holds the same full logits. A packed head
        (--quant_lm_head) holds this rank's rows."""
        if isinstance(self.lm_head, QLinear):
            local = self.head_logits(h)
        else:
            w = self.lm_head.weight
            if w.shape[0] != len(self.vocab):  # tied: the head is the replicated embedding; this rank's rows of it
                w = w[self.vocab.start : self.vocab.stop]
            local = self.kernels.linear(h, w, self.lm_head.bias)
        full = torch.nn.functional.pad(local, (self.vocab.start, self.config.vocab_size - self.vocab.stop))
        return self.kernels.all_reduce(full, self.tp.group)
