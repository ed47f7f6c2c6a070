"""PEFT's LoRA layers seen as ``lora_linear`` calls: which wrapped projections the model may compute itself.

A PEFT ``lora.Linear`` in its plain state (one active adapter, not merged or disabled, no DoRA or other variant, no
LoRA bias, dropout an ``nn.Dropout`` or none, no hooks, no autocast) computes ``base(x) + lora_B(lora_A(dropout(x)))
* scaling``: exactly ``ops/lora_linear.py``. For those the model calls the op (one GEMM for a fused ``qkv_proj`` /
``gate_up_proj`` however many of its parts carry adapters, and less saved for the backward); any other state, or a
module this file does not recognize, is called as a module, so PEFT's own forward runs. Duck-typed on PEFT's
attributes: peft is not imported here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from polyfuse.models.projection_slice import ProjectionSlice
from polyfuse.ops.lora_linear import LoraAdapter


def _plain_linear(m) -> bool:
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and not _hooked(m)


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _is_peft_lora_linear(m) -> bool:
    cls = type(m)
    return cls.__name__ == "Linear" and cls.__module__ == "peft.tuners.lora.layer"


def _dropout_p(drop: nn.Module) -> Optional[float]:
    if type(drop) is nn.Identity:
        return 0.0
    if type(drop) is nn.Dropout and not _hooked(drop):
        return float(drop.p) if drop.training else 0.0
    return None


def plain_lora(module: nn.Module, x: torch.Tensor) -> Optional[tuple[nn.Module, LoraAdapter]]:
    """``(base_layer, adapter on all its rows)`` when ``module`` is PEFT's LoRA Linear in the plain state (above) and
    ``lora_linear`` gives what its forward would for ``x``; else None."""
    if not _is_peft_lora_linear(module) or _hooked(module):
        return None
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return None
    if module.disable_adapters or module.merged:
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name, False):
        return None
    if getattr(module, "lora_bias", {}).get(name, False):
        return None
    lora_a, lora_b = module.lora_A[name], module.lora_B[name]
    if not (_plain_linear(lora_a) and _plain_linear(lora_b)) or lora_a.bias is not None or lora_b.bias is not None:
        return None
    p = _dropout_p(module.lora_dropout[name])
    if p is None or (p > 0 and x.device.type not in ("cpu", "cuda")):
        return None  # native_dropout draws F.dropout's mask on CPU and CUDA; elsewhere PEFT's module runs
    if x.dtype != lora_a.weight.dtype and not getattr(module, "cast_input_dtype_enabled", True):
        return None
    if torch.is_autocast_enabled(x.device.type):
        return None
    base = module.base_layer
    if not _plain_linear(base):
        return None
    adapter = LoraAdapter(0, base.out_features, lora_a.weight, lora_b.weight, float(module.scaling[name]), p)
    return base, adapter


def fused_adapters(fused: nn.Module, parts, x: torch.Tensor) -> Optional[tuple[LoraAdapter, ...]]:
    """The adapters on ``fused``'s rows when each of ``parts`` (its ``ProjectionSlice`` children, in row order) is
    either still the bare slice or PEFT's plain LoRA over that slice: the fused GEMM then runs once with them added.
    None when any part is something else (that part must run as a module)."""
    if not _plain_linear(fused):
        return None
    adapters = []
    for m in parts:
        if type(m) is ProjectionSlice and m.fused() is fused:
            continue
        lora = plain_lora(m, x)
        if lora is None:
            return None
        base, adapter = lora
        if type(base) is not ProjectionSlice or base.fused() is not fused:
            return None
        adapters.append(dataclasses.replace(adapter, start=base.start, stop=base.stop))
    return tuple(adapters)
