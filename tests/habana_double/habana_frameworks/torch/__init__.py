"""TEST DOUBLE of ``habana_frameworks.torch``: importing it makes ``core`` and ``hpu`` available, as the real one.

Like the real bridge it asks ``utils.internal.is_lazy()`` at import time (the real one loads a different library per
mode), so the mode is fixed from here on. Importing it makes ``hpu`` a device (``_device.py``: HPU tensors whose
data lives in host memory, lazy-mode graphs, HPU graph capture and replay) and registers ``torch.hpu``, as the real
bridge registers the device. In eager mode it registers the ``hpu_backend`` torch.compile backend (``_compile.py``).
"""

from habana_frameworks.torch.utils.internal import is_lazy


LAZY_AT_IMPORT = is_lazy()

from habana_frameworks.torch import _device, _fp8_ops, _int4_ops, core, hpu  # noqa: E402,F401  (torch.ops.hpu's ops)


_device.enable(hpu, LAZY_AT_IMPORT)

if not LAZY_AT_IMPORT:
    from habana_frameworks.torch import _compile

    _compile.register()
