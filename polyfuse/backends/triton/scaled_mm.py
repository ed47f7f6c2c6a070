"""fp8 weights on the fp8 tensor cores for many rows (prefill): the activations quantized to e4m3 per token by one
Triton kernel, then ``torch._scaled_mm`` with row-wise scales (ops/quant_linear.py ``scaled_mm_rows``).

The plain-torch quantization (backends/cuda/scaled_mm.py: abs, amax, a float32 copy, a division, a clamp, a cast)
reads and writes the activations six times per projection; on a 2048-token prefill of the Llama-3-8B shape that made
the fp8 prefill no faster than bf16 (50.2 against 49.5 ms, docs/benchmarks.md run 16). Here each program reads one
row once, takes its amax, and writes the e4m3 row and its float32 scale: the same arithmetic (scale = max(amax,
1e-12) / 448, x / scale clamped to +-448, rounded to nearest even), so both quantize a row to the same bytes.

Takes what ``scaled_mm_refusal`` allows with more than MAX_GEMM_ROWS rows (fewer go to the dequantizing GEMM,
quant_gemm.py, which reads the fp8 weight directly and keeps the activations in bf16), rows of at most MAX_K
elements (one program holds a row); declines the rest to cuda:scaled_mm and then the native reference.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._util import rows
from polyfuse.ops.quant_formats import FP8_MAX
from polyfuse.ops.quant_linear import scaled_mm_refusal, scaled_mm_rows


MAX_K = 32768


@triton.jit
def e4m3_bits(q):
    """float32 values within +-448 -> their e4m3fn codes (uint8), rounded to nearest even, by integer arithmetic:
    the same bytes as torch's ``.to(torch.float8_e4m3fn)`` on the GPU and under the CPU interpreter (whose own
    float -> fp8 cast rounds differently). With e = max(floor(log2 |q|), -6), the code is ((e + 7) << 3) + rint(|q|
    * 2^(3 - e)) - 8: the mantissa's carry into the exponent and the subnormals (e = -6) need no special case."""
    bits = q.to(tl.uint32, bitcast=True)
    a = tl.abs(q)
    e = tl.maximum(((a.to(tl.uint32, bitcast=True) >> 23) & 255).to(tl.int32) - 127, -6)
    step = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e), exact
    m = (a * step + 8388608.0) - 8388608.0  # rint: below 2^23 the sum keeps no fraction (nearest even)
    code = ((e + 7) << 3) + m.to(tl.int32) - 8
    return (((bits >> 31) << 7).to(tl.int32) | code).to(tl.uint8)


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, sx, sq, FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    mask = k < K
    x = tl.load(X + r * sx + k, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), FP8_MAX)  # IEEE division, as torch's
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    tl.store(Q + r * sq + k, e4m3_bits(q), mask=mask)
    tl.store(S + r, scale)


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (e4m3 [M, K], float32 scales [M, 1]), one scale per row (token)."""
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.uint8, device=x2.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    block = triton.next_power_of_2(k)
    warps = 4 if block <= 4096 else 8 if block <= 8192 else 16
    _quantize_rows_kernel[(m,)](
        x2, q, s, k, x2.stride(0), q.stride(0), FP8_MAX=FP8_MAX, BLOCK_K=block, num_warps=warps
    )
    return q.view(torch.float8_e4m3fn), s


def accepts_linear_q(x, qweight, bias=None) -> Optional[str]:
    from polyfuse.backends.triton.quant_gemm import MAX_ROWS

    why = scaled_mm_refusal(x, qweight)
    if why is not None:
        return why
    k = qweight.shape[1]
    if x.numel() // k <= MAX_ROWS:
        return f"{MAX_ROWS} rows or fewer (the dequantizing GEMM's)"
    if k > MAX_K:
        return f"rows of more than {MAX_K} elements"
    return None


def linear_q(x, qweight, bias=None):
    xq, scale_a = quantize_rows(rows(x, qweight.shape[1]))
    return scaled_mm_rows(xq, scale_a, qweight, x, bias)
