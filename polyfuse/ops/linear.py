"""Linear layers of the decode step as ops, so a backend can replace the library GEMM where it loses.

``linear(x, weight, bias)`` is ``F.linear``; ``swiglu_linear(gate, up, weight, bias)`` is ``F.linear(silu(gate) *
up, weight, bias)``, the MLP's down projection with its gate folded in. Both are inference-only ops (training keeps
the reference, ``F.linear`` with its autograd); their fused implementations are opt-in through the run flag
``use_gemv_kernels`` or the overrides ``linear=<impl>`` / ``swiglu_linear=<impl>`` until a benchmark shows they
win on the device (examples/benchmark_linear.py, docs/benchmarks.md).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from polyfuse.backends.registry import OpSpec, declare
from polyfuse.ops.swiglu import swiglu_native


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def swiglu_linear_native(gate, up, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(swiglu_native(gate, up), weight, bias)


SPEC = declare(
    OpSpec(
        "linear",
        "linear(x[..., K], weight[N, K], bias[N] | None) -> [..., N]",
        linear_native,
        enable_flag="use_gemv_kernels",
        training=False,
    )
)
SWIGLU_SPEC = declare(
    OpSpec(
        "swiglu_linear",
        "swiglu_linear(gate[..., I], up[..., I], weight[N, I], bias[N] | None) -> (silu(gate) * up) @ weight.T",
        swiglu_linear_native,
        enable_flag="use_gemv_kernels",
        training=False,
    )
)
