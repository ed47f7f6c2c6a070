"""Registers the NVIDIA-only implementations that need no Triton (SDPA's flash choice, fp8 through torch._scaled_mm,
the symmetric-memory all-reduce) and the CUDA runtime (the ``cuda`` entry point). Imports no kernel and no other
backend: the tuned Triton GEMV of ``linear`` is the ``triton`` plugin's."""

from __future__ import annotations

from typing import Optional

import torch

import polyfuse.ops  # noqa: F401  (declares the ops before we register against them)
from polyfuse.core.context import SelectionContext
from polyfuse.core.plugins import lazy_function
from polyfuse.core.registry import Implementation
from polyfuse.core.registry import register as register_impl
from polyfuse.core.runtime import register_runtime


BACKEND = "cuda"
DEVICES = ("cuda",)
PLATFORMS = ("cuda",)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PRIORITY = 100


def probe_sdpa(ctx: SelectionContext) -> Optional[str]:
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        return "torch has no scaled_dot_product_attention"
    if ctx.dtype not in DTYPES:
        return f"dtype {str(ctx.dtype).replace('torch.', '')} unsupported"
    return None


SCALED_MM_NOTE = "per-channel fp8 weights, bf16: x quantized to e4m3 per token + torch._scaled_mm"


def probe_scaled_mm(ctx: SelectionContext) -> Optional[str]:
    from polyfuse.ops.quant_linear import scaled_mm_probe

    return scaled_mm_probe(ctx)


def _scaled_mm() -> Implementation:
    """fp8 weights (polyfuse/ops/quant_linear.py) on fp8 tensor cores, ranked below the Triton one-row GEMV."""
    mod = "polyfuse.backends.cuda.scaled_mm"
    return Implementation(
        "linear_q", "scaled_mm", BACKEND, DEVICES, lazy_function(mod, "linear_q"), PRIORITY - 10, probe_scaled_mm,
        note=SCALED_MM_NOTE, platforms=PLATFORMS, accepts=lazy_function(mod, "accepts_linear_q"), quiet_decline=True,
        options=True,
    )  # fmt: skip


SYMM_NOTE = "decode-sized tensors: one-shot all-reduce over NVLink peer memory (torch symmetric memory)"


def probe_symm_all_reduce(ctx: SelectionContext) -> Optional[str]:
    from polyfuse.backends.cuda import symm_all_reduce

    if ctx.dtype not in DTYPES:
        return f"dtype {str(ctx.dtype).replace('torch.', '')} unsupported"
    return symm_all_reduce.unusable()


def _symm_all_reduce() -> Implementation:
    """A faster all_reduce for the tensor-parallel decode step; larger inputs are declined to NCCL (native)."""
    mod = "polyfuse.backends.cuda.symm_all_reduce"
    return Implementation(
        "all_reduce", "symm_one_shot", BACKEND, DEVICES, lazy_function(mod, "all_reduce"), PRIORITY,
        probe_symm_all_reduce, supports_backward=False, note=SYMM_NOTE, platforms=PLATFORMS,
        accepts=lazy_function(mod, "accepts_all_reduce"), quiet_decline=True,
    )  # fmt: skip


def implementations() -> list[Implementation]:
    sdpa = lazy_function("polyfuse.backends.cuda.attention", "sdpa_attention")
    return [
        Implementation(
            "attention", "sdpa_flash", BACKEND, DEVICES, sdpa, PRIORITY, probe_sdpa, True, platforms=PLATFORMS
        ),
        _scaled_mm(),
        _symm_all_reduce(),
    ]


_done = []


def register() -> None:
    """The ``polyfuse.backends`` entry point ``cuda``."""
    if _done:
        return
    from polyfuse.backends.cuda.runtime import CudaRuntime

    for impl in implementations():
        register_impl(impl)
    register_runtime("cuda", CudaRuntime)
    _done.append(True)
