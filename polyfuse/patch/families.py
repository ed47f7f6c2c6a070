"""transformers' model families ``polyfuse.patch`` knows: each modeling module names its classes
``<Prefix>RMSNorm``, ``<Prefix>MLP``, ``<Prefix>Attention`` (whose forward calls the module global
``apply_rotary_pos_emb``), ``<Prefix>DecoderLayer``, ``<Prefix>Model`` and ``<Prefix>ForCausalLM``."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

from torch import nn


PREFIXES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


@dataclass(frozen=True)
class Family:
    model_type: str
    RMSNorm: type
    MLP: type
    Attention: type
    DecoderLayer: type
    Model: type
    ForCausalLM: type


def family_classes(model_type: str) -> Family:
    prefix = PREFIXES[model_type]
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    names = ("RMSNorm", "MLP", "Attention", "DecoderLayer", "Model", "ForCausalLM")
    return Family(model_type, *(getattr(mod, prefix + n) for n in names))


def find_family(model: nn.Module) -> Optional[Family]:
    """The family of the first transformers decoder found in ``model`` (plain or PEFT-wrapped), or None."""
    for m in model.modules():
        cls = type(m)
        parts = cls.__module__.split(".")
        if len(parts) == 4 and parts[:2] == ["transformers", "models"] and parts[2] in PREFIXES:
            fam = family_classes(parts[2])
            if isinstance(m, fam.Model):
                return fam
    return None
