"""Model families on the shared decoder (``decoder.py``): Llama, Mistral, Qwen2, Qwen3; ``auto.py`` picks one from
a checkpoint's ``model_type``; ``eagle3.py``: EAGLE-3 draft heads for speculative decoding (``load_eagle3``)."""

from polyfuse.models.auto import (
    FAMILIES,
    AutoModelForCausalLM,
    family_for,
    register_auto_classes,
    unregister_auto_classes,
)
from polyfuse.models.decoder import CausalLMOutput, DecoderForCausalLM
from polyfuse.models.eagle3 import Eagle3Head
from polyfuse.models.eagle3_checkpoint import load_eagle3
from polyfuse.models.llama import LlamaForCausalLM
from polyfuse.models.mistral import MistralForCausalLM
from polyfuse.models.qwen2 import Qwen2ForCausalLM
from polyfuse.models.qwen3 import Qwen3ForCausalLM
from polyfuse.quant.hf_quantizer import register as _register_quantizer


_register_quantizer()  # transformers then refuses polyfuse's quantized saves in one line (quant/hf_quantizer.py)

__all__ = [
    "FAMILIES",
    "AutoModelForCausalLM",
    "CausalLMOutput",
    "DecoderForCausalLM",
    "Eagle3Head",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "family_for",
    "load_eagle3",
    "register_auto_classes",
    "unregister_auto_classes",
]
