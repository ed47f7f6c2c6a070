"""Registers the HPU implementations and runtime (the ``hpu`` entry point).

Importing this module never imports ``habana_frameworks``: the probes do, lazily and cached, when the registry
resolves a model build on device ``hpu``.
"""

from __future__ import annotations

from typing import Optional

import polyfuse.ops  # noqa: F401  (declares the ops before we register against them)
from polyfuse.backends.hpu import _habana, fp8_linear, int4_linear
from polyfuse.backends.hpu.attention import fused_sdpa
from polyfuse.backends.hpu.paged_attention import paged_fused_sdpa
from polyfuse.backends.hpu.rms_norm import fused_add_rms_norm, fused_rms_norm
from polyfuse.backends.hpu.rotary import fused_rope
from polyfuse.backends.hpu.runtime import HpuRuntime
from polyfuse.core.context import SelectionContext
from polyfuse.core.registry import Implementation
from polyfuse.core.registry import register as register_impl
from polyfuse.core.runtime import register_runtime


BACKEND = "hpu"
DEVICES = ("hpu",)
PRIORITY = 100


def _probe(module: str, name: str):
    def probe(ctx: SelectionContext) -> Optional[str]:
        return _habana.missing_reason(module, name)

    probe.__name__ = f"probe_{name}"
    return probe


def _impl(op: str, name: str, fn, module: str, attr: str) -> Implementation:
    """A Habana kernel implementation (with backward), usable when ``module.attr`` imports."""
    return Implementation(
        op, name, BACKEND, DEVICES, fn, priority=PRIORITY, probe=_probe(module, attr), supports_backward=True
    )


IMPLEMENTATIONS = [
    _impl("attention", "fused_sdpa", fused_sdpa, _habana.KERNELS, "FusedSDPA"),
    _impl("rms_norm", "fused_rms_norm", fused_rms_norm, _habana.NORMALIZATION, "FusedRMSNorm"),
    _impl("add_rms_norm", "fused_add_rms_norm", fused_add_rms_norm, _habana.NORMALIZATION, "FusedRMSNorm"),
    _impl("rotary", "fused_rope", fused_rope, _habana.KERNELS, "RotaryPosEmbeddingHelperV2"),
    # Serving: the paged cache gathered per bucket, then FusedSDPA
    _impl("paged_attention", "paged_fused_sdpa", paged_fused_sdpa, _habana.KERNELS, "FusedSDPA"),
]


def probe_fp8_gemm(ctx: SelectionContext) -> Optional[str]:
    return fp8_linear.missing_reason()


IMPLEMENTATIONS.append(
    Implementation(
        "linear_q", "fp8_gemm", BACKEND, DEVICES, fp8_linear.fp8_gemm, priority=PRIORITY, probe=probe_fp8_gemm,
        accepts=fp8_linear.accepts_linear_q, note="per-channel fp8, activations cast to e4m3 per token",
    )
)  # fmt: skip


def probe_uint4(ctx: SelectionContext) -> Optional[str]:
    return int4_linear.missing_reason()


IMPLEMENTATIONS.append(
    Implementation(
        "linear_q", "uint4_matmul", BACKEND, DEVICES, int4_linear.uint4_matmul, priority=PRIORITY - 1,
        probe=probe_uint4, accepts=int4_linear.accepts_linear_q,
        note="int4 (GPTQ layout) dequantized by convert_from_uint4, then matmul",
    )
)  # fmt: skip

_done = []


def register() -> None:
    """The ``polyfuse.backends`` entry point ``hpu``."""
    if not _done:
        for impl in IMPLEMENTATIONS:
            register_impl(impl)
        register_runtime("hpu", HpuRuntime)
        _done.append(True)
