"""Registers the NVIDIA implementations. Nothing here imports triton: probes import it (once, cached) and the
kernel modules are imported on first call, so ``import polyfuse`` works without triton."""

import functools
import importlib
from typing import Optional

import torch

import polyfuse.ops  # noqa: F401  (declares the ops before we register against them)
from polyfuse.backends.registry import Implementation, SelectionContext, register


BACKEND = "cuda"
DEVICES = ("cuda",)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PRIORITY = 100


@functools.lru_cache(maxsize=None)
def triton_unusable() -> Optional[str]:
    """None when triton imports, else why not (cached: probes run once per op per model build)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything else
        return f"triton not importable ({type(e).__name__}: {e})"[:160]
    return None


def _dtype_reason(ctx: SelectionContext) -> Optional[str]:
    if ctx.dtype not in DTYPES:
        return f"dtype {str(ctx.dtype).replace('torch.', '')} unsupported"
    return None


def _device_reason(ctx: SelectionContext) -> Optional[str]:
    if ctx.device.type != "cuda":
        return f"needs device cuda, run is on {ctx.device.type}"
    return None


def probe_triton(ctx: SelectionContext) -> Optional[str]:
    return _device_reason(ctx) or triton_unusable() or _dtype_reason(ctx)


def probe_sdpa(ctx: SelectionContext) -> Optional[str]:
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        return "torch has no scaled_dot_product_attention"
    return _device_reason(ctx) or _dtype_reason(ctx)


def probe_triton_inference(ctx: SelectionContext) -> Optional[str]:
    if ctx.training:
        return "inference only"
    return probe_triton(ctx)


def probe_triton_decode(ctx: SelectionContext) -> Optional[str]:
    if ctx.training:
        return "decode kernel is inference only"
    return probe_sdpa(ctx) or triton_unusable()


def lazy(module: str, attr: str):
    """A function that imports ``polyfuse.backends.cuda.<module>`` on its first call and forwards to ``attr``."""
    target = []

    def fn(*args, **kwargs):
        if not target:
            target.append(getattr(importlib.import_module(f"polyfuse.backends.cuda.{module}"), attr))
        return target[0](*args, **kwargs)

    fn.__name__ = fn.__qualname__ = attr
    fn.__doc__ = f"polyfuse.backends.cuda.{module}.{attr} (imported on first call)"
    return fn


def _impl(op, name, module, attr, probe, priority=PRIORITY, backward=True, note=""):
    return Implementation(
        op, name, BACKEND, DEVICES, lazy(module, attr), priority, probe, supports_backward=backward, note=note
    )


GEMV_NOTE = "Triton GEMV on the one-row shapes it was tuned for (gemv.TUNED), cuBLAS otherwise"


IMPLEMENTATIONS = [
    _impl("rms_norm", "triton", "rms_norm", "rms_norm", probe_triton),
    _impl("add_rms_norm", "triton", "add_rms_norm", "add_rms_norm", probe_triton),
    _impl("rotary", "triton", "rotary", "rotary", probe_triton),
    _impl("swiglu", "triton", "swiglu", "swiglu", probe_triton),
    _impl("rotary_kv_write", "triton", "rotary_kv_write", "rotary_kv_write", probe_triton_inference, backward=False),
    _impl("linear_cross_entropy", "triton_chunked", "linear_cross_entropy", "linear_cross_entropy", probe_triton),
    _impl("attention", "sdpa_flash", "attention", "sdpa_attention", probe_sdpa),
    # Inference only (no backward): Lq == 1 runs the split-K kernel, other shapes go to SDPA inside the call
    # (probes see the run, not the shapes).
    _impl("linear", "triton_gemv", "gemv", "linear", probe_triton_inference, backward=False, note=GEMV_NOTE),
    _impl(
        "swiglu_linear", "triton_gemv", "gemv", "swiglu_linear", probe_triton_inference, backward=False, note=GEMV_NOTE
    ),
    _impl(
        "attention", "triton_decode", "decode_attention", "decode_attention", probe_triton_decode, PRIORITY + 10, False
    ),
]

for _i in IMPLEMENTATIONS:
    register(_i)
