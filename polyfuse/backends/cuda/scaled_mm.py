"""fp8 weights on NVIDIA's fp8 tensor cores: ``torch._scaled_mm`` with the activations quantized to e4m3 per token
(one scale per row: amax / 448) and the weight's per-channel scales (row-wise scaling, bfloat16 output).

It takes per-channel ``fp8`` weights with bfloat16 activations, K and N multiples of 16; every other call (other
formats, other dtypes) is declined to the registry's next choice. The activations' quantization makes it W8A8: its
results differ from the weight-only reference by the e4m3 rounding of the activations (about 2% relative).
"""

from typing import Optional

import torch


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def accepts_linear_q(x, qweight, bias=None) -> Optional[str]:
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


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) with x ~= q * scale, one scale per row (token)."""
    scale = x2.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x2.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def linear_q(x, qweight, bias=None):
    n, k = qweight.shape
    xq, scale_a = quantize_rows(x.reshape(-1, k))
    w = qweight.qweight  # [N, K] row-major: its transpose is the column-major mat2 scaled_mm wants
    y = torch._scaled_mm(xq, w.t(), scale_a=scale_a, scale_b=qweight.scales.float().view(1, n), out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)
