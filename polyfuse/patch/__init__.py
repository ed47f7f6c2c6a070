"""Patch a transformers Llama *instance* so its RMSNorm, rotary, attention, MLP and loss run through the registry.

``patch(model)`` rebinds methods on the model's own modules (like Liger-Kernel's ``_bind_method_to_module``: the new
method goes into the instance ``__dict__``, classes and other models are untouched) and ``unpatch(model)`` restores
everything. PEFT wrappers need no special case: every Llama module found by ``model.modules()`` is patched, which
includes both copies inside a ``ModulesToSaveWrapper``.
"""

from polyfuse.patch.llama import PatchHandle, patch, unpatch


__all__ = ["PatchHandle", "patch", "unpatch"]
