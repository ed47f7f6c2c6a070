"""Patch a transformers decoder *instance* (Llama, Mistral, Qwen2, Qwen3) so its RMSNorm, rotary, attention, MLP
and loss run through the registry.

``patch(model)`` rebinds methods on the model's own modules (like Liger-Kernel's ``_bind_method_to_module``: the new
method goes into the instance ``__dict__``, classes and other models are untouched) and ``unpatch(model)`` restores
everything. PEFT wrappers need no special case: every module of the family found by ``model.modules()`` is patched,
which includes both copies inside a ``ModulesToSaveWrapper``.

``polyfuse.patch`` is both this package and the function: ``polyfuse.patch(model)`` works before and after
``import polyfuse.patch`` (the module is callable).
"""

import sys
import types

from polyfuse.patch.hf import PatchHandle, patch, unpatch
from polyfuse.quant.hf_quantizer import register as _register_quantizer


_register_quantizer()  # transformers refuses polyfuse's quantized saves in one line (quant/hf_quantizer.py)


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return patch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["PatchHandle", "patch", "unpatch"]
