"""A layer's input norm and the quantized projection that reads it, as one op.

``add_rms_norm_linear_q(x, residual, weight, eps, qweight, bias)`` is ``linear_q(rms_norm(x + residual), qweight,
bias)`` together with the sum ``x + residual`` (the next residual); with ``residual=None`` it is
``linear_q(rms_norm(x))`` and returns ``x``. The decoder calls it where a layer's qkv or gate/up projection is one
quantized weight (models/decoder.py ``normed_projection``). Its composite definition is the run's own
``add_rms_norm`` (or ``rms_norm``) followed by its ``linear_q``, so by default nothing changes; a backend registers a
fused implementation where the norm and the projection's input preparation meet: for fp8 prefill, one kernel writes
the sum and the normalized rows already quantized to e4m3 per token, so the normalized rows are never written in
bfloat16 and read back (backends/triton/quant/norm_fp8_scaled_mm.py).
"""

from typing import Optional

import torch

from polyfuse.core.registry import OpSpec, declare
from polyfuse.ops.add_rms_norm import add_rms_norm_native
from polyfuse.ops.quant_formats import QuantizedWeight
from polyfuse.ops.quant_linear import linear_q_native
from polyfuse.ops.rms_norm import rms_norm_native


def add_rms_norm_linear_q_native(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, qweight: QuantizedWeight,
    bias: Optional[torch.Tensor] = None,
):  # fmt: skip
    if residual is None:
        y, r = rms_norm_native(x, weight, eps), x
    else:
        y, r = add_rms_norm_native(x, residual, weight, eps)
    return linear_q_native(y, qweight, bias), r


def compose_add_rms_norm_linear_q(kernels):
    """The run's own norm (``add_rms_norm``, or ``rms_norm`` without a residual) then its ``linear_q``."""

    def add_rms_norm_linear_q(x, residual, weight, eps, qweight, bias=None):
        if residual is None:
            y, r = kernels.rms_norm(x, weight, eps), x
        else:
            y, r = kernels.add_rms_norm(x, residual, weight, eps)
        return kernels.linear_q(y, qweight, bias), r

    return add_rms_norm_linear_q


SPEC = declare(
    OpSpec(
        "add_rms_norm_linear_q",
        "add_rms_norm_linear_q(x[..., H], residual[..., H] | None, weight[H], eps, qweight: QuantizedWeight[N, H], "
        "bias[N] | None) -> (linear_q(rms_norm(x + residual)) [..., N], x + residual)",
        add_rms_norm_linear_q_native,
        training=False,
        compose=compose_add_rms_norm_linear_q,
        composed_of=("add_rms_norm", "linear_q"),
    )
)
