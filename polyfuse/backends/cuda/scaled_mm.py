"""fp8 weights on NVIDIA's fp8 tensor cores: ``torch._scaled_mm`` with the activations quantized to e4m3 per token
by plain torch ops (one scale per row: amax / 448; x * (448 / amax) rounded to e4m3), and the weight's per-channel
scales (row-wise scaling, bfloat16 output). The Triton backend's triton:fp8_scaled_mm (backends/triton/quant/fp8_scaled_mm.py)
is the same GEMM with the per-token quantization in one kernel, ranked above this one; this is what runs without
Triton.

It takes per-channel ``fp8`` weights with bfloat16 activations, K and N multiples of 16 (ops/quant_linear.py
``scaled_mm_refusal``); every other call is declined to the registry's next choice. The activations' quantization
makes it W8A8: its results differ from the weight-only reference by the e4m3 rounding of the activations (about 2%
relative).
"""

from typing import Optional

import torch

from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.quant_linear import fp8_token_rows, scaled_mm_refusal, scaled_mm_rows


def accepts_linear_q(x, qweight, bias=None, options=DEFAULT) -> Optional[str]:
    return scaled_mm_refusal(x, qweight)


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) with x ~= q * scale, one scale per row (token): the ops'
    reference, ops/quant_linear.py ``fp8_token_rows``."""
    return fp8_token_rows(x2)


def linear_q(x, qweight, bias=None, options=DEFAULT):
    xq, scale_a = quantize_rows(x.reshape(-1, qweight.shape[1]))
    return scaled_mm_rows(xq, scale_a, qweight, x, bias, options)
