"""Linear layers of the decode step as ops, so a backend can replace the library GEMM where it loses.

``linear(x, weight, bias)`` is ``F.linear``; ``swiglu_linear(gate, up, weight, bias)`` is ``F.linear(silu(gate) *
up, weight, bias)``, the MLP's down projection with its gate folded in. ``linear`` is inference-only (training keeps
the reference, ``F.linear`` with its autograd). ``swiglu_linear`` also has training implementations: where none is
chosen the composite (the run's swiglu, then linear) runs; the Triton one (opt-in: ``swiglu_linear=triton_recompute``)
recomputes the product in its backward instead of keeping it (backends/triton/swiglu_linear.py). A backend's inference implementation may take only the
shapes where it was measured to win (CUDA: a Triton GEMV for tuned one-row decode shapes, cuBLAS for the rest);
``-linear`` / ``-swiglu_linear`` force the reference.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from polyfuse.core.registry import OpSpec, declare
from polyfuse.ops.swiglu import swiglu_native


def linear_native(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def swiglu_linear_native(gate, up, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(swiglu_native(gate, up), weight, bias)


def compose_swiglu_linear(kernels):
    """linear(swiglu(gate, up)) from the run's own choices of both ops."""

    def swiglu_linear(gate, up, weight, bias=None):
        return kernels.linear(kernels.swiglu(gate, up), weight, bias)

    return swiglu_linear


SPEC = declare(
    OpSpec(
        "linear",
        "linear(x[..., K], weight[N, K], bias[N] | None) -> [..., N]",
        linear_native,
        training=False,
        compile=False,  # one cuBLAS call: on a GPU without GEMV tables compiling it hit dynamo's recompile limit
    )
)
SWIGLU_SPEC = declare(
    OpSpec(
        "swiglu_linear",
        "swiglu_linear(gate[..., I], up[..., I], weight[N, I], bias[N] | None) -> (silu(gate) * up) @ weight.T",
        swiglu_linear_native,
        compose=compose_swiglu_linear,
        composed_of=("swiglu", "linear"),
    )
)
