"""Projections on quantized weights as ops: the registry picks how a packed weight is multiplied.

``linear_q(x, qweight, bias)`` is ``F.linear(x, dequantize(qweight), bias)`` and ``swiglu_linear_q(gate, up,
qweight, bias)`` is the MLP's down projection with SwiGLU folded in, both on a
:class:`~polyfuse.ops.quant_formats.QuantizedWeight` (formats: polyfuse/ops/quant_formats.py). The native references
dequantize the whole weight to the activations' dtype and call ``F.linear`` (on a GPU: dequantize + cuBLAS, what
the larger batches get); a backend's implementation may read the packed weight directly (a one-row GEMV
dequantizing in its loads) or quantize the activations too (fp8 ``torch._scaled_mm``) and declines the inputs it
does not take. Inference-only ops: a training run keeps the references (gradients flow to ``x``, not the weight).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from polyfuse.core.registry import OpSpec, declare
from polyfuse.ops.quant_formats import QuantizedWeight, dequantize
from polyfuse.ops.swiglu import swiglu_native


def linear_q_native(x: torch.Tensor, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(x, dequantize(qweight, x.dtype), bias)


def swiglu_linear_q_native(gate, up, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(swiglu_native(gate, up), dequantize(qweight, gate.dtype), bias)


def compose_swiglu_linear_q(kernels):
    """linear_q(swiglu(gate, up)) from the run's own choices of both ops."""

    def swiglu_linear_q(gate, up, qweight, bias=None):
        return kernels.linear_q(kernels.swiglu(gate, up), qweight, bias)

    return swiglu_linear_q


SPEC = declare(
    OpSpec(
        "linear_q",
        "linear_q(x[..., K], qweight: QuantizedWeight[N, K], bias[N] | None) -> [..., N]",
        linear_q_native,
        training=False,
    )
)
SWIGLU_SPEC = declare(
    OpSpec(
        "swiglu_linear_q",
        "swiglu_linear_q(gate[..., I], up[..., I], qweight: QuantizedWeight[N, I], bias[N] | None) -> [..., N]",
        swiglu_linear_q_native,
        training=False,
        compose=compose_swiglu_linear_q,
        composed_of=("swiglu", "linear_q"),
    )
)
