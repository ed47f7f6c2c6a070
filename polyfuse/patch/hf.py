"""In-place patching of transformers' decoders of the families in ``families.py`` (Llama, Mistral, Qwen2, Qwen3;
``XForCausalLM`` / ``XModel``, plain or PEFT-wrapped).

What is swapped, per instance (X is the family's class prefix):
  * ``XRMSNorm.forward``                -> ``kernels.rms_norm`` (Qwen3's per-head q/k norms included)
  * ``XDecoderLayer.forward``           -> same layer, residual add + post-attention norm through ``kernels.add_rms_norm``
  * ``XAttention.forward``              -> transformers' own forward (whatever version is installed), with its
                                           ``apply_rotary_pos_emb`` global swapped for ``kernels.rotary``
  * attention                           -> ``kernels.attention`` through transformers' ``AttentionInterface`` under the
                                           name ``"polyfuse"`` (only when the registry picked a fused implementation or
                                           one was requested by name; otherwise the model keeps its sdpa/eager path)
  * ``XMLP.forward``                    -> ``down_proj(kernels.swiglu(gate_proj(x), up_proj(x)))``
  * ``XForCausalLM.forward``            -> with labels, ``kernels.linear_cross_entropy`` over the final hidden states
                                           (logits are never materialized and ``.logits`` is None); without labels,
                                           logits as before. A forward already set on the instance (TRL's fused
                                           LM head) is kept, with a note.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from polyfuse.core.registry import NATIVE, Kernels, SelectionContext, resolve
from polyfuse.ops.attention import options_from_flags
from polyfuse.patch.families import find_family


ATTN_NAME = "polyfuse"
_STATE_KEY = "_polyfuse_patch"
_KERNELS_KEY = "_polyfuse_kernels"
_MISSING = object()


# --------------------------------------------------------------------------------------------------- attention hook


def _to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def polyfuse_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs,
):
    """transformers' attention-function convention -> ``kernels.attention(q, k, v, AttentionMeta)``.

    q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (not repeated), mask: None (causal, no padding: transformers' sdpa mask
    skipped it), bool (True keeps) or additive float [B, 1, Lq, Lk]. Returns ([B, Lq, Hq, D], None) like sdpa.
    """
    from polyfuse.ops.attention import AttentionMeta

    kernels: Optional[Kernels] = module.__dict__.get(_KERNELS_KEY)
    if kernels is None or (dropout and module.training):
        # Not a patched module (or attention dropout in training, which the op does not do): transformers' sdpa.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    q_len, k_len = query.shape[2], key.shape[2]
    is_causal = attention_mask is None and q_len > 1 and getattr(module, "is_causal", True)
    if attention_mask is not None:
        attention_mask = _to_additive(attention_mask[:, :, :, :k_len], query.dtype)
    meta = AttentionMeta(
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        mask=attention_mask,
        is_causal=is_causal,
        decode=q_len == 1 and k_len > 1,
        **options_from_flags(kernels.context.flags),
    )
    out = kernels.attention(query, key, value, meta)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register_attention() -> None:
    """Register ``"polyfuse"`` with transformers' AttentionInterface and (for mask creation) AttentionMaskInterface."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, polyfuse_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        # Same masks as sdpa: None when causal with no padding (-> is_causal), otherwise a boolean mask.
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    except ImportError:  # pragma: no cover - older transformers build masks from the attention name alone
        pass
    _registered = True


# --------------------------------------------------------------------------------------------------- new forwards


def _rms_norm_forward(kernels: Kernels):
    def forward(self, hidden_states):
        return kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon)

    return forward


def _mlp_forward(kernels: Kernels):
    def forward(self, x):
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))

    return forward


def _decoder_layer_forward(kernels: Kernels):
    def forward(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attn_out, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **kwargs,
        )
        norm = self.post_attention_layernorm
        hidden_states, residual = kernels.add_rms_norm(attn_out, residual, norm.weight, norm.variance_epsilon)
        return residual + self.mlp(hidden_states)

    return forward


def _attention_forward(cls, kernels: Kernels):
    """transformers' own ``XAttention.forward`` for the installed version, re-created with its module global
    ``apply_rotary_pos_emb`` pointing at ``kernels.rotary``: nothing global changes and the rest of the code (cache
    update, attention dispatch) stays exactly transformers'."""
    inner = inspect.unwrap(cls.forward)
    orig_rope = inner.__globals__["apply_rotary_pos_emb"]

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kw):
        if unsqueeze_dim != 1 or kw:
            return orig_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, **kw)
        # transformers' q * cos promotes: under bf16 autocast q is bf16 and cos float32, so the rotated q and k are
        # float32. The op keeps its inputs' dtype, so it gets them promoted.
        q, k = q.to(torch.promote_types(q.dtype, cos.dtype)), k.to(torch.promote_types(k.dtype, cos.dtype))
        return kernels.rotary(q, k, cos, sin)

    glb = dict(inner.__globals__)
    glb["apply_rotary_pos_emb"] = apply_rotary_pos_emb
    clone = types.FunctionType(inner.__code__, glb, inner.__name__, inner.__defaults__, inner.__closure__)
    clone.__kwdefaults__ = inner.__kwdefaults__
    params = inspect.signature(inner).parameters

    def forward(self, *args, **kwargs):
        # transformers renamed past_key_values -> cache (5.2x); the outer deprecation wrapper is gone, so map here.
        for old, new in (("past_key_values", "cache"), ("cache", "past_key_values")):
            if old in kwargs and old not in params and new in params:
                kwargs[new] = kwargs.pop(old)
        return clone(self, *args, **kwargs)

    return forward


def _lm_head_weight(lm_head: nn.Module) -> Optional[torch.Tensor]:
    """The [V, H] weight of a plain linear head (also inside a PEFT ModulesToSaveWrapper); None when the head is
    something else (LoRA on the head, a bias), in which case the loss goes through the logits."""
    if hasattr(lm_head, "modules_to_save") and hasattr(lm_head, "active_adapter"):
        active = lm_head.active_adapter
        active = active[0] if isinstance(active, (list, tuple)) else active
        if active in lm_head.modules_to_save:
            lm_head = lm_head.modules_to_save[active]
        elif hasattr(lm_head, "original_module"):
            lm_head = lm_head.original_module
    if _unsharded_type(lm_head) is nn.Linear and lm_head.bias is None:
        return lm_head.weight
    return None


def _unsharded_type(module: nn.Module) -> type:
    """The module's class; for a module FSDP2's ``fully_shard`` wrapped (its class swapped for ``FSDP<Class>``, a
    subclass of ``FSDPModule`` and the original) the original class, so a sharded plain head keeps the fused loss."""
    cls = type(module)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return cls
    if issubclass(cls, FSDPModule) and len(cls.__bases__) == 2 and cls.__bases__[0] is FSDPModule:
        return cls.__bases__[1]
    return cls


def _causal_lm_forward(kernels: Kernels):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        return_dict = kwargs.pop("return_dict", None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        loss = logits = None
        weight = _lm_head_weight(self.lm_head)
        if (labels is not None or shift_labels is not None) and weight is not None:
            if shift_labels is None:
                shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
            shift_labels = shift_labels.reshape(-1).to(hidden.device)
            flat = hidden.reshape(-1, hidden.shape[-1])
            if num_items_in_batch is None:
                loss = kernels.linear_cross_entropy(flat, weight, shift_labels, -100, "mean")
            else:
                loss = kernels.linear_cross_entropy(flat, weight, shift_labels, -100, "sum")
                if torch.is_tensor(num_items_in_batch):
                    num_items_in_batch = num_items_in_batch.to(loss.device)
                loss = loss / num_items_in_batch
        else:
            if isinstance(logits_to_keep, int):
                kept = hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden
            else:
                kept = hidden[:, logits_to_keep, :]
            logits = self.lm_head(kept)
            if labels is not None or shift_labels is not None:  # head without a plain weight: transformers' loss
                loss = self.loss_function(
                    logits=logits,
                    labels=labels,
                    vocab_size=self.config.vocab_size,
                    num_items_in_batch=num_items_in_batch,
                    shift_labels=shift_labels,
                )
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        cache = getattr(outputs, "cache", None) or getattr(outputs, "past_key_values", None)
        if cache is not None:
            out["cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"] = cache
        return out.to_tuple() if return_dict is False else out

    return forward


# --------------------------------------------------------------------------------------------------- the handle


@dataclass
class PatchHandle:
    kernels: Kernels
    patched: dict = field(default_factory=dict)  # what -> count
    notes: list = field(default_factory=list)
    _saved: list = field(default_factory=list)  # (obj, key, old value or _MISSING)
    _config: Optional[object] = None
    _old_attn: object = _MISSING

    def set(self, obj, key, value) -> None:
        self._saved.append((obj, key, obj.__dict__.get(key, _MISSING)))
        obj.__dict__[key] = value

    def bind(self, module: nn.Module, name: str, fn) -> None:
        """Liger's _bind_method_to_module: the method goes into the instance __dict__, self is bound."""
        self.set(module, name, fn.__get__(module, type(module)))

    def restore(self) -> None:
        for obj, key, old in reversed(self._saved):
            if old is _MISSING:
                obj.__dict__.pop(key, None)
            else:
                obj.__dict__[key] = old
        self._saved.clear()
        if self._config is not None and self._old_attn is not _MISSING:
            self._config._attn_implementation = self._old_attn
        self._config = None

    def report(self) -> str:
        lines = [self.kernels.report()]
        done = ", ".join(f"{n} x{c}" for n, c in self.patched.items() if c)
        lines.append(f"  patched in place: {done or 'nothing'}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _wants_attention(kernels: Kernels) -> bool:
    choice = kernels.choices["attention"]
    return choice.implementation.name != NATIVE or choice.reason.startswith("requested by override")


def _model_device_dtype(model: nn.Module):
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    return torch.device("cpu"), torch.float32


def patch(
    model: nn.Module,
    device=None,
    flags: Optional[dict] = None,
    overrides: str = "",
    training: Optional[bool] = None,
    kernels: Optional[Kernels] = None,
) -> PatchHandle:
    """Route a transformers decoder instance's RMSNorm, rotary, attention, MLP and loss through the op registry.

    ``device``/``dtype`` default to the model's parameters, ``training`` to ``model.training`` (training runs only
    pick implementations with a backward). ``kernels`` skips the registry (tests, or a Kernels built elsewhere).
    Patching twice re-patches; ``unpatch(model)`` restores the exact original behaviour.
    """
    ml = find_family(model)
    if ml is None:
        raise TypeError(
            f"polyfuse.patch supports transformers' Llama, Mistral, Qwen2 and Qwen3 models; got {type(model).__name__}"
        )
    if find_handle(model) is not None:
        unpatch(model)
    p_device, p_dtype = _model_device_dtype(model)
    if kernels is None:
        ctx = SelectionContext(
            device=torch.device(device) if device is not None else p_device,
            dtype=p_dtype,
            flags=dict(flags or {}),
            training=model.training if training is None else bool(training),
            overrides=overrides or "",
        )
        kernels = resolve(ctx)
    handle = PatchHandle(kernels)
    counts = dict.fromkeys(("rms_norm", "add_rms_norm", "rotary", "attention", "swiglu", "linear_cross_entropy"), 0)
    use_attn = _wants_attention(kernels)
    if use_attn:
        register_attention()
    configs = []
    for m in model.modules():
        if isinstance(m, ml.RMSNorm):
            handle.bind(m, "forward", _rms_norm_forward(kernels))
            counts["rms_norm"] += 1
        elif isinstance(m, ml.MLP):
            if getattr(m.config, "hidden_act", "silu") in ("silu", "swish"):
                handle.bind(m, "forward", _mlp_forward(kernels))
                counts["swiglu"] += 1
            else:
                handle.notes.append(f"MLP with hidden_act={m.config.hidden_act!r} left as is")
        elif isinstance(m, ml.Attention):
            handle.bind(m, "forward", _attention_forward(type(m), kernels))
            counts["rotary"] += 1
            if use_attn:
                handle.set(m, _KERNELS_KEY, kernels)
                counts["attention"] += 1
        elif isinstance(m, ml.DecoderLayer):
            if isinstance(m.post_attention_layernorm, ml.RMSNorm):
                handle.bind(m, "forward", _decoder_layer_forward(kernels))
                counts["add_rms_norm"] += 1
        elif isinstance(m, ml.ForCausalLM):
            if "forward" in m.__dict__:  # a forward someone set on this instance (TRL's fused LM head): kept
                handle.notes.append(
                    f"{type(m).__name__}.forward was replaced on this instance ({_owner_of(m.__dict__['forward'])}): "
                    "kept: it computes the loss, the layers under it run the patched ops"
                )
            else:
                handle.bind(m, "forward", _causal_lm_forward(kernels))
                counts["linear_cross_entropy"] += 1
        if isinstance(m, ml.Model) and m.config not in configs:
            configs.append(m.config)
    if use_attn:
        cfg = configs[0]
        handle._config, handle._old_attn = cfg, cfg._attn_implementation
        cfg._attn_implementation = ATTN_NAME
    else:
        attn = configs[0]._attn_implementation
        handle.notes.append(f"attention: registry chose native, the model keeps transformers' {attn!r} attention")
    handle.patched = counts
    model.__dict__[_STATE_KEY] = handle
    return handle


def _owner_of(fn) -> str:
    """Where a function comes from, for a note: its module (``trl.trainer.utils``)."""
    return getattr(getattr(fn, "__func__", fn), "__module__", None) or type(fn).__name__


def find_handle(model: nn.Module) -> Optional[PatchHandle]:
    h = model.__dict__.get(_STATE_KEY)
    if h is not None:
        return h
    for m in model.modules():
        h = m.__dict__.get(_STATE_KEY)
        if h is not None:
            return h
    return None


def unpatch(model: nn.Module) -> bool:
    """Restore every method and setting ``patch`` changed. Returns False when the model was not patched."""
    for m in [model, *model.modules()]:
        h = m.__dict__.pop(_STATE_KEY, None)
        if h is not None:
            h.restore()
            return True
    return False
