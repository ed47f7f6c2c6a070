"""Registers the portable Triton kernels (the ``triton`` entry point). Importing this module imports no kernel and
not triton: probes import triton once (cached), each kernel module is imported on its first call."""

from __future__ import annotations

import functools
from typing import Optional

import torch

import polyfuse.ops  # noqa: F401  (declares the ops before we register against them)
from polyfuse.core.context import SelectionContext
from polyfuse.core.plugins import lazy_function
from polyfuse.core.registry import Implementation
from polyfuse.core.registry import register as register_impl


BACKEND = "triton"
DEVICES = ("cuda",)
PLATFORMS = ("cuda", "rocm")
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


def probe_triton(ctx: SelectionContext) -> Optional[str]:
    if ctx.dtype not in DTYPES:
        return f"dtype {str(ctx.dtype).replace('torch.', '')} unsupported"
    return triton_unusable()


def probe_inference(ctx: SelectionContext) -> Optional[str]:
    return "inference only" if ctx.training else probe_triton(ctx)


def probe_training_fold(ctx: SelectionContext) -> Optional[str]:
    """swiglu_linear's training implementation: training only, and not where the run forced SwiGLU native (the
    composite, which calls the run's own swiglu choice, honours that)."""
    from polyfuse.core.registry import run_overrides

    if not ctx.training:
        return "training only (inference: the GEMV or the composite)"
    if run_overrides(ctx).get("swiglu") == "-":
        return "swiglu forced native (-swiglu): the composite runs"
    return probe_triton(ctx)


def _impl(op, name, module, attr, probe=probe_triton, priority=PRIORITY, backward=True, accepts=False, quiet=False):
    return Implementation(
        op, name, BACKEND, DEVICES, lazy_function(f"polyfuse.backends.triton.{module}", attr), priority, probe,
        supports_backward=backward, platforms=PLATFORMS,
        accepts=lazy_function(f"polyfuse.backends.triton.{module}", "accepts") if accepts else None,
        quiet_decline=quiet,
    )  # fmt: skip


def implementations() -> list[Implementation]:
    return [
        _impl("rms_norm", "triton", "rms_norm", "rms_norm"),
        _impl("add_rms_norm", "triton", "add_rms_norm", "add_rms_norm"),
        _impl("rotary", "triton", "rotary", "rotary"),
        _impl("swiglu", "triton", "swiglu", "swiglu"),
        _impl(
            "rotary_kv_write",
            "triton",
            "rotary_kv_write",
            "rotary_kv_write",
            probe_inference,
            backward=False,
            accepts=True,
        ),
        _impl("linear_cross_entropy", "triton_chunked", "linear_cross_entropy", "linear_cross_entropy"),
        # Training's down projection: keeps no silu(gate) * up product (recomputed in the backward).
        _impl("swiglu_linear", "triton_recompute", "swiglu_linear", "swiglu_linear", probe_training_fold, PRIORITY - 1),
        # One-query decode steps only; prefill and anything else is declined to the next choice (SDPA).
        _impl(
            "attention",
            "triton_decode",
            "decode_attention",
            "decode_attention",
            probe_inference,
            PRIORITY + 10,
            backward=False,
            accepts=True,
            quiet=True,
        ),
    ]


QUANT_NOTE = "one row: Triton GEMV dequantizing int8/int4/fp8/fp8_block/gguf_q8_0/q4_0/q4_1 in its loads"


def quant_implementations() -> list[Implementation]:
    """The linear ops on quantized weights (polyfuse/ops/quant_linear.py): a one-row GEMV dequantizing in its
    loads; more rows (and anything else it declines) go to the next choice, the native dequantize + matmul."""
    mod = "polyfuse.backends.triton.quant_gemv"
    return [
        Implementation(
            op,
            "gemv_q",
            BACKEND,
            DEVICES,
            lazy_function(mod, op),
            PRIORITY,
            probe_inference,
            supports_backward=False,
            note=QUANT_NOTE,
            platforms=PLATFORMS,
            accepts=lazy_function(mod, "accepts_" + op),
            quiet_decline=True,
        )
        for op in ("linear_q", "swiglu_linear_q")
    ]


_done = []


def register() -> None:
    """The ``polyfuse.backends`` entry point ``triton``."""
    if not _done:
        for impl in implementations() + quant_implementations():
            register_impl(impl)
        _done.append(True)
