"""polyfuse: Llama-family models (Llama, Mistral, Qwen2, Qwen3) on fused ops chosen per device by a registry.

Light to import: the model, the patch and the trainer load on first use.
"""

import sys


__version__ = "0.1.0"

_LAZY = {
    "AutoModelForCausalLM": "polyfuse.models",
    "LlamaForCausalLM": "polyfuse.models",
    "MistralForCausalLM": "polyfuse.models",
    "Qwen2ForCausalLM": "polyfuse.models",
    "Qwen3ForCausalLM": "polyfuse.models",
    "patch": "polyfuse.patch",
    "unpatch": "polyfuse.patch",
    "PolyfuseTrainer": "polyfuse.training",
    "PolyfuseTrainingArguments": "polyfuse.training",
    "resolve": "polyfuse.core",
    "SelectionContext": "polyfuse.core",
    "load_tokenizer": "polyfuse.checkpoint.tokenizer",
    "builtin_model": "polyfuse.models.builtin",
}

__all__ = list(_LAZY)

if "transformers" in sys.modules:  # already paid for: transformers refuses polyfuse's quantized saves in one line
    from polyfuse.quant.hf_quantizer import register as _register_quantizer

    _register_quantizer()


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'polyfuse' has no attribute {name!r}")


def __dir__():
    # The lazy names too, so that dir(polyfuse) and tab completion show the public API before first use.
    return sorted(set(globals()) | set(_LAZY))
