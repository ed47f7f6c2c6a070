"""Pick the family from a checkpoint, as transformers' Auto classes do: config.json's ``model_type``, or a GGUF's
``general.architecture``. ``FAMILIES`` is the one table to extend with a new family."""

from __future__ import annotations

from typing import Optional

import torch

from polyfuse.core import kernel_options
from polyfuse.core.errors import CheckpointError
from polyfuse.loader.load import checkpoint_model_type, from_config
from polyfuse.models.hf_model import load_pretrained
from polyfuse.models.llama import LlamaForCausalLM
from polyfuse.models.mistral import MistralForCausalLM
from polyfuse.models.qwen2 import Qwen2ForCausalLM
from polyfuse.models.qwen3 import Qwen3ForCausalLM


FAMILIES = {
    cls.model_types[0]: cls for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
}


def family_for(model_type: Optional[str], where: str = "checkpoint"):
    cls = FAMILIES.get(model_type) if isinstance(model_type, str) else None  # a list (architectures) is unhashable
    if cls is None:
        raise CheckpointError(
            f"{where}: model_type {model_type or 'unknown'!s} is not supported; polyfuse runs "
            + ", ".join(sorted(FAMILIES))
        )
    return cls


class AutoModelForCausalLM:
    """``AutoModelForCausalLM.from_pretrained(path, dtype=..., device=..., flags=..., **kwargs)``: the family from
    the checkpoint, then that family's ``from_pretrained``; ``kwargs``: transformers' keywords (models/hf_model.py)
    and kernel options (polyfuse/core/kernel_options.py: ``int4_a8=True``, ``pdl=False``, ...)."""

    @staticmethod
    def from_pretrained(path, gguf_file=None, dtype=None, device=None, flags=None, overrides="", training=False,
                        quant=None, progress=None, quant_lm_head=False,
                        **kwargs):  # fmt: skip  # size: transformers' keywords, plus polyfuse's
        options = dict(flags=flags, overrides=overrides, training=training, quant=quant, progress=progress,
                       quant_lm_head=quant_lm_head)  # fmt: skip
        return load_pretrained(_family_of_checkpoint, path, gguf_file, dtype, device, options, kwargs)

    @staticmethod
    def from_config(config, dtype=torch.float32, device="cpu", flags=None, overrides="", training=False, seed=0,
                    quant=None, **options):  # fmt: skip
        cls = family_for(getattr(config, "model_type", None), "config")
        flags = kernel_options.merge(flags, options)
        return from_config(cls, config, dtype, device, flags, overrides, training, seed, quant=quant)


def _family_of_checkpoint(folder: str, gguf_file):
    model_type, where = checkpoint_model_type(folder, gguf_file)
    return family_for(model_type, where)


_previous: dict = {}  # config class -> what transformers' AutoModelForCausalLM mapped it to before registration


def register_auto_classes() -> None:
    """Make transformers' ``AutoModelForCausalLM`` (and with it ``pipeline("text-generation", model=path)``, which
    loads through it) build polyfuse's model for every family polyfuse runs, in this process, until
    :func:`unregister_auto_classes`. Opt-in: transformers' own classes stay the default."""
    from transformers import AutoModelForCausalLM as HFAuto

    extra = HFAuto._model_mapping._extra_content  # the registrations that override transformers' table
    for cls in FAMILIES.values():
        if cls.config_class not in _previous:
            _previous[cls.config_class] = extra.get(cls.config_class)
        HFAuto.register(cls.config_class, cls, exist_ok=True)


def unregister_auto_classes() -> None:
    """Give transformers' ``AutoModelForCausalLM`` back what it mapped the families to before."""
    from transformers import AutoModelForCausalLM as HFAuto

    extra = HFAuto._model_mapping._extra_content
    for config_class, before in _previous.items():
        if before is None:
            extra.pop(config_class, None)
        else:
            extra[config_class] = before
    _previous.clear()
