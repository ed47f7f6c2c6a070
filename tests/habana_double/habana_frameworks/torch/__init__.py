"""TEST DOUBLE of ``habana_frameworks.torch``: importing it makes ``core`` and ``hpu`` available, as the real one.

Like the real bridge it asks ``utils.internal.is_lazy()`` at import time (the real one loads a different library per
mode), so the mode is fixed from here on; in eager mode it registers the ``hpu_backend`` torch.compile backend (here:
a recording pass-through that runs the captured FX graph as is).
"""

from habana_frameworks.torch.utils.internal import is_lazy


LAZY_AT_IMPORT = is_lazy()

from habana_frameworks.torch import _fp8_ops, _int4_ops, core, hpu  # noqa: E402,F401  (torch.ops.hpu's ops)


def _register_hpu_backend():
    try:
        from torch._dynamo import list_backends, register_backend
    except ImportError:  # pragma: no cover - torch without dynamo
        return
    if "hpu_backend" in list_backends(exclude_tags=()):
        return

    def hpu_backend(gm, example_inputs, **kwargs):
        import sys

        double = sys.modules.get("habana_frameworks")
        if double is not None:
            double.record("hpu_backend.compile", len(gm.graph.nodes))
        return gm.forward

    register_backend(hpu_backend, name="hpu_backend")


if not LAZY_AT_IMPORT:
    _register_hpu_backend()
