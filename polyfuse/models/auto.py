"""Pick the family from a checkpoint, as transformers' Auto classes do: config.json's ``model_type``, or a GGUF's
``general.architecture``. ``FAMILIES`` is the one table to extend with a new family."""

from __future__ import annotations

from typing import Optional

import torch

from polyfuse.core import kernel_options
from polyfuse.core.errors import CheckpointError
from polyfuse.loader.load import checkpoint_model_type, from_config, from_pretrained
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
    """``AutoModelForCausalLM.from_pretrained(path, dtype=..., device=..., flags=..., **kernel_options)``: the family
    from the checkpoint, then that family's ``from_pretrained``. Keyword arguments beyond the named ones are kernel
    options (polyfuse/core/kernel_options.py: ``int4_a8=True``, ``pdl=False``, ...), added to ``flags``."""

    @staticmethod
    def from_pretrained(path, gguf_file=None, dtype=torch.float32, device="cpu", flags=None, overrides="",
                        training=False, quant=None, progress=None, quant_lm_head=False, **options):  # fmt: skip
        model_type, where = checkpoint_model_type(path, gguf_file)
        cls = family_for(model_type, where)
        return from_pretrained(
            cls, path, gguf_file, dtype, device, kernel_options.merge(flags, options), overrides, training,
            quant=quant, progress=progress, quant_lm_head=quant_lm_head,
        )  # fmt: skip

    @staticmethod
    def from_config(config, dtype=torch.float32, device="cpu", flags=None, overrides="", training=False, seed=0,
                    quant=None, **options):  # fmt: skip
        cls = family_for(getattr(config, "model_type", None), "config")
        flags = kernel_options.merge(flags, options)
        return from_config(cls, config, dtype, device, flags, overrides, training, seed, quant=quant)
