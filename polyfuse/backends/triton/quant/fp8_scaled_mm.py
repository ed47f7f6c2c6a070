"""fp8 weights on the fp8 tensor cores for many rows (prefill): the activations quantized to e4m3 per token by one
Triton kernel, then ``torch._scaled_mm`` with row-wise scales (ops/quant_linear.py ``scaled_mm_rows``).

The plain-torch quantization (backends/cuda/scaled_mm.py: abs, amax, a float32 copy, a multiply, a clamp, a cast)
reads and writes the activations six times per projection; on a 2048-token prefill of the Llama-3-8B shape that made
the fp8 prefill no faster than bf16 (50.2 against 49.5 ms on an H200). Here each program reads its
rows (one, or a few short ones: TILES) once, takes each row's amax, and writes the e4m3 rows and their float32 scales:
the same arithmetic (amax = max(|x|, 1e-12), x * (448 / amax) clamped to +-448, rounded to nearest even; scale amax /
448: two IEEE divisions per row, none per element), so both quantize a row to the same bytes. On the GPU the e4m3
rounding is the hardware conversion (``cvt.rn.satfinite``, sm_89+); under the CPU interpreter, whose own float -> fp8
cast rounds differently, the same rounding by integer arithmetic.

The down projection's input is SwiGLU's output: ``swiglu_linear_q`` computes ``silu(gate) * up``, rounds it to the
activations' dtype (as the separate SwiGLU kernel stores it) and quantizes it in the same pass, so the [tokens, I]
product is never written in bfloat16 and read back (on the 8B shape at 2048 tokens: 58 MB each way per layer).

Takes what ``scaled_mm_refusal`` allows with more than MAX_GEMM_ROWS rows (fewer go to the dequantizing GEMM,
gemm_q.py, which reads the fp8 weight directly and keeps the activations in bf16), rows of at most MAX_K
elements (one program holds a row); declines the rest to cuda:scaled_mm (swiglu_linear_q: the composite) and then
the native reference.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import INTERPRET, cast_rne
from polyfuse.backends.triton._util import rows
from polyfuse.backends.triton.quant.gemm_q import MAX_ROWS
from polyfuse.core.kernel_options import DEFAULT
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
def _store_quantized_rows(x, Q, S, r, M, sq, k, mask, FP8_MAX: tl.constexpr, HW_CVT: tl.constexpr):
    """Rows ``r`` [R] of float32 values ``x`` [R, BLOCK_K] -> e4m3 codes at Q[r] and each row's scale at S[r]."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
    fp8_max = tl.full(amax.shape, FP8_MAX, tl.float32)
    inv = tl.math.div_rn(fp8_max, amax)  # IEEE divisions, as torch's (per row)
    q = tl.minimum(tl.maximum(x * inv[:, None], -FP8_MAX), FP8_MAX)
    if HW_CVT:
        code = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        code = e4m3_bits(q)
    tl.store(Q + r[:, None] * sq + k[None, :], code, mask=mask)
    tl.store(S + r, tl.math.div_rn(amax, fp8_max), mask=r < M)


@triton.jit
def _quantize_rows_kernel(
    X, Q, S, M, K, sx, sq, FP8_MAX: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HW_CVT: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    mask = (r[:, None] < M) & (k[None, :] < K)
    x = tl.load(X + r[:, None] * sx + k[None, :], mask=mask, other=0.0).to(tl.float32)
    _store_quantized_rows(x, Q, S, r, M, sq, k, mask, FP8_MAX, HW_CVT)


@triton.jit
def _swiglu_quantize_rows_kernel(
    G, U, Q, S, M, K, sg, su, sq, FP8_MAX: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    HW_CVT: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    mask = (r[:, None] < M) & (k[None, :] < K)
    g = tl.load(G + r[:, None] * sg + k[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r[:, None] * su + k[None, :], mask=mask, other=0.0).to(tl.float32)
    y = cast_rne(g * tl.sigmoid(g) * u, G.dtype.element_ty).to(tl.float32)  # what the SwiGLU kernel stores
    _store_quantized_rows(y, Q, S, r, M, sq, k, mask, FP8_MAX, HW_CVT)


# (rows per program, warps) by the row's power-of-two length, from a sweep on the H200 (2048 rows).
TILES = {4096: (4, 16), 8192: (2, 16), 16384: (1, 32)}


def launch_quantizing(kernel, tensors, strides, m, k, device, tiles=None, **extra):
    """Run a kernel that writes [m, k] rows quantized per row (``_store_quantized_rows``): its arguments are
    ``tensors``, the e4m3 rows and scales it fills, m, k, ``strides``, the rows' stride, then ``extra`` by name.
    Returns (e4m3 [m, k], float32 scales [m, 1]). ``tiles``: (rows per program, warps) by the row's power-of-two
    length (TILES)."""
    q = torch.empty((m, k), dtype=torch.uint8, device=device)
    s = torch.empty((m, 1), dtype=torch.float32, device=device)
    block = triton.next_power_of_2(k)
    rows_per, warps = (tiles or TILES).get(block, (max(1, 4096 // block), 4 if block <= 4096 else 32))
    hw = device.type == "cuda" and not INTERPRET
    grid = (triton.cdiv(m, rows_per),)
    kernel[grid](
        *tensors, q, s, m, k, *strides, q.stride(0), FP8_MAX=FP8_MAX, ROWS=rows_per, BLOCK_K=block, HW_CVT=hw,
        num_warps=warps, **extra,
    )  # fmt: skip
    return q.view(torch.float8_e4m3fn), s


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (e4m3 [M, K], float32 scales [M, 1]), one scale per row (token)."""
    m, k = x2.shape
    return launch_quantizing(_quantize_rows_kernel, (x2,), (x2.stride(0),), m, k, x2.device)


def swiglu_quantize_rows(g2: torch.Tensor, u2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(silu(gate) * up) with the product rounded to gate's dtype, in one pass (unit column strides)."""
    m, k = g2.shape
    return launch_quantizing(_swiglu_quantize_rows_kernel, (g2, u2), (g2.stride(0), u2.stride(0)), m, k, g2.device)


def accepts_linear_q(x, qweight, bias=None, options=DEFAULT) -> Optional[str]:
    why = scaled_mm_refusal(x, qweight)
    if why is not None:
        return why
    k = qweight.shape[1]
    if x.numel() // k <= MAX_ROWS:
        return f"{MAX_ROWS} rows or fewer (the dequantizing GEMM's)"
    if k > MAX_K:
        return f"rows of more than {MAX_K} elements"
    return None


def accepts_swiglu_linear_q(gate, up, qweight, bias=None, options=DEFAULT) -> Optional[str]:
    if up.shape != gate.shape or up.dtype != gate.dtype:
        return "gate and up differ in shape or dtype"
    if torch.is_grad_enabled() and up.requires_grad:
        return "needs gradients"
    return accepts_linear_q(gate, qweight, bias)


def linear_q(x, qweight, bias=None, options=DEFAULT):
    xq, scale_a = quantize_rows(rows(x, qweight.shape[1]))
    return scaled_mm_rows(xq, scale_a, qweight, x, bias, options)


def swiglu_linear_q(gate, up, qweight, bias=None, options=DEFAULT):
    k = qweight.shape[1]
    xq, scale_a = swiglu_quantize_rows(rows(gate, k), rows(up, k))
    return scaled_mm_rows(xq, scale_a, qweight, gate, bias, options)
