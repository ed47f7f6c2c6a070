"""An out-of-tree polyfuse backend: ``rms_norm`` on the CPU through PyTorch's own RMSNorm
(``torch.nn.functional.rms_norm``, one ATen op) instead of the native reference's pow / mean / rsqrt / mul.

polyfuse finds this package through the entry point ``example = "polyfuse_example_backend:register"`` of the group
``polyfuse.backends`` (pyproject.toml) and calls ``register()`` once, at its first resolve. Importing polyfuse
never imports this package by name.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

import polyfuse.core as pf


BACKEND = "example"
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The ``rms_norm`` op's contract (polyfuse/ops/rms_norm.py): statistics in fp32 (fp64 stays fp64), the
    normalized value rounded to x's dtype, then scaled by ``weight``. Same rounding steps as the reference, so on the
    CPU the result equals it bit for bit (checked with torch 2.13; tests/test_plugins.py compares generated text)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return weight * F.rms_norm(xf, (x.shape[-1],), eps=eps).to(x.dtype)


def probe(ctx: pf.SelectionContext) -> Optional[str]:
    """None when this implementation can run for the model build described by ``ctx``, else why not."""
    if not hasattr(F, "rms_norm"):
        return "torch has no torch.nn.functional.rms_norm"
    if ctx.dtype not in DTYPES:
        return f"dtype {str(ctx.dtype).replace('torch.', '')} unsupported"
    return None


IMPLEMENTATION = pf.Implementation(
    op="rms_norm",
    name="torch_rms_norm",
    backend=BACKEND,
    devices=("cpu",),
    fn=rms_norm,
    priority=10,  # above the native reference (-1000); built-in backends use 100 on their own devices
    probe=probe,
    supports_backward=True,  # F.rms_norm has autograd, so training runs may pick it too
)

_done = []


def register() -> None:
    """The ``polyfuse.backends`` entry point. Called once per process; guarded so a second call is harmless."""
    if _done:
        return
    import polyfuse.ops  # noqa: F401  (declares the ops before we register against them)

    pf.register(IMPLEMENTATION)
    # A backend for a new device type would also register its runtime here:
    # pf.register_runtime("mydev", MyDeviceRuntime)   (a polyfuse.core.DeviceRuntime subclass)
    _done.append(True)
