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

from polyfuse.core.kernel_options import DEFAULT
from polyfuse.core.registry import OpSpec, declare
from polyfuse.ops.quant_formats import FP8_MAX, QuantizedWeight, dequantize
from polyfuse.ops.swiglu import swiglu_native


def linear_q_native(x: torch.Tensor, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(x, dequantize(qweight, x.dtype), bias)


def swiglu_linear_q_native(gate, up, qweight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(swiglu_native(gate, up), dequantize(qweight, gate.dtype), bias)


# ---- row-wise scaled fp8 GEMM: what the implementations calling torch._scaled_mm share -----------------------------


def fp8_token_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) with x ~= q * scale, one scale per row (token): the
    per-token quantization of fp8's W8A8 GEMMs (cuda:scaled_mm runs this; triton:fp8_scaled_mm's kernel has the same
    arithmetic and bytes). amax = max |x| in float32 (at least 1e-12), x * (448 / amax) clamped to +-448 and rounded
    to e4m3 (nearest even), scale amax / 448."""
    amax = x2.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
    # IEEE divisions, as the Triton kernel's: torch computes ``FP8_MAX / amax`` as a reciprocal times 448 and, on the
    # GPU, ``amax / FP8_MAX`` as a product with 1 / 448; a division by a tensor is a true division.
    fp8_max = torch.full_like(amax, FP8_MAX)
    return (x2.float() * (fp8_max / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), amax / fp8_max


def fp8_activations(x: torch.Tensor, group: int = 0) -> torch.Tensor:
    """x as a W8A8 fp8 GEMM multiplies it, float32: each row (token) quantized by ``fp8_token_rows`` and back; with
    ``group`` each ``group`` columns of a row on their own (fp8_block's 1 x 128 activation blocks; K a multiple of
    it). The product with the dequantized weight is then what the GEMM accumulates, up to its summation order."""
    k = x.shape[-1]
    rows = x.reshape(-1, group if group else k)
    q, scale = fp8_token_rows(rows)
    return (q.float() * scale).view(x.shape)


def scaled_mm_probe(ctx) -> Optional[str]:
    """Why a run cannot use torch._scaled_mm with row-wise scales (None: it can): training, no _scaled_mm in this
    torch, a GPU without fp8 tensor cores (compute capability below 8.9), activations other than bfloat16."""
    if ctx.training:
        return "inference only"
    if not hasattr(torch, "_scaled_mm"):
        return "torch has no _scaled_mm"
    cap = tuple(ctx.platform.capability or ())
    if cap and cap < (8, 9):
        return f"fp8 tensor cores need compute capability >= 8.9 (this GPU: {cap[0]}.{cap[1]})"
    name = str(ctx.dtype).replace("torch.", "")
    if ctx.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {name} unsupported"
    if ctx.dtype != torch.bfloat16:
        return f"row-wise fp8 scaled_mm needs bfloat16 (run is {name})"
    return None


def scaled_mm_refusal(x: torch.Tensor, qweight: QuantizedWeight) -> Optional[str]:
    """Why torch._scaled_mm with row-wise scales does not take this call (None: it does)."""
    if qweight.format != "fp8":
        return f"{qweight.format} weights (takes per-channel fp8)"
    if x.dtype != torch.bfloat16:
        return "row-wise scaled_mm needs bfloat16 activations"
    n, k = qweight.shape
    if k % 16 or n % 16 or x.shape[-1] != k:
        return "K and N must be multiples of 16"
    if torch.is_grad_enabled() and x.requires_grad:
        return "needs gradients"
    return None


# Hopper's fp8 tensor cores accumulate K in a narrower register unless the GEMM promotes partial sums to float32
# every few steps; "fast accumulation" skips it: opt-in (fp8_fast_accum), since it put one GPU test's output far off.
def fast_accum(device: torch.device, options=DEFAULT) -> bool:
    """Whether ``_scaled_mm`` on ``device`` runs with fast accumulation: on GPUs in a run with the kernel option
    ``fp8_fast_accum``; never on the CPU, whose kernel has no such mode."""
    return options.fp8_fast_accum and device.type == "cuda"


def scaled_mm_rows(xq, scale_a, qweight: QuantizedWeight, x: torch.Tensor, bias=None, options=DEFAULT):
    """y = (xq * scale_a) @ (qweight * its channel scales).T in x's dtype and shape: e4m3 rows xq [M, K] with
    float32 scales [M, 1] (how they were quantized is the caller's), on the fp8 tensor cores."""
    n = qweight.shape[0]
    w = qweight.qweight  # [N, K] row-major: its transpose is the column-major mat2 scaled_mm wants
    y = torch._scaled_mm(
        xq, w.t(), scale_a=scale_a, scale_b=qweight.scales.float().view(1, n), out_dtype=x.dtype,
        use_fast_accum=fast_accum(xq.device, options),
    )  # fmt: skip
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


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
