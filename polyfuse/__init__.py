"""polyfuse: one Llama code base, fused ops chosen per device by a registry.

Light to import: the model, the patch and the trainer load on first use.
"""

__version__ = "0.1.0"

_LAZY = {
    "LlamaForCausalLM": "polyfuse.models.llama",
    "patch": "polyfuse.patch",
    "unpatch": "polyfuse.patch",
    "PolyfuseTrainer": "polyfuse.training",
    "PolyfuseTrainingArguments": "polyfuse.training",
    "resolve": "polyfuse.backends.registry",
    "SelectionContext": "polyfuse.backends.registry",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'polyfuse' has no attribute {name!r}")
