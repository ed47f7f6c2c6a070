"""Dequantizing GEMM on GGUF weights kept as stored (Q8_0 / Q4_0 / Q4_1 and the K-quants Q4_K / Q5_K / Q6_K), for a
few rows (gemm_q.py takes it past the int8-activation GEMV's 8 rows for Q4_0 / Q4_1 up to 64 and Q8_0 / Q4_K up
to 32: where it was measured faster than dequantize + cuBLAS; gemm_q.GGUF_GEMM).

y[M, N] = x[M, K] @ w[K, N], w[k, n] the reference's dequantized weight (quant_formats ``dequantize``). Grid (N
tiles, M tiles, K splits) as gemm_int8_fp8.py's: each program owns a [BLOCK_M, BLOCK_N] output tile (BLOCK_M covers a
decode batch, so each packed byte is read once per call) and walks its share of K in BLOCK_K steps; each step builds
the weight tile as [BLOCK_K / 32 groups of 32 weights, 32, BLOCK_N] from the blocks' bytes (a 32-weight block, or one
32-weight sub-block of a 256-weight super-block, is one group: its scale, and min, per group), computes every weight
as dequant_gguf.py / dequant_gguf_kquant.py do (exact float32 products, so after the rounding to the activations' dtype
the reference's bits), and multiplies it on the tensor cores with the activation tile (float activations: weight-only,
unlike the int8-activation GEMV). SWIGLU folds silu(gate) * up into the activation loads. Inference only.
dequant_mm.py instead writes the whole weight in the activations' dtype and runs cuBLAS: about 4.5 bytes of traffic
per 4-bit weight against this kernel's 0.56-0.63.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import INTERPRET  # the interpreter has no bfloat16 dot: float32 products
from polyfuse.backends.triton.quant.gemm_common import (
    dot_acc,
    launch_plan,
    load_a,
    store_tile,
    tiles_for,
)
from polyfuse.backends.triton.quant.gemv_common import counters, workspace
from polyfuse.backends.triton.quant.gemv_gguf_kquant import q4_k_scale_min, q6_k_quants, q45_k_quants
from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.quant_formats import GGUF_BYTES


# format -> FMT code of the tile below
CODES = {"gguf_q8_0": 0, "gguf_q4_0": 1, "gguf_q4_1": 2, "gguf_q4_k": 3, "gguf_q5_k": 4, "gguf_q6_k": 5}


@triton.jit
def _half(W16, at, mask):
    """The float32 value of the fp16 at byte ``at`` (even)."""
    return tl.load(W16 + at // 2, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def gguf_tile(W, W16, k0, k_end, n, n_mask, row_bytes, FMT: tl.constexpr, BYTES: tl.constexpr,
              BLOCK_K: tl.constexpr):  # fmt: skip
    """The float32 [BLOCK_K, BLOCK_N] tile w[k, n], k in k0 .. k0 + BLOCK_K (k0 a multiple of 32; zeros from k_end),
    of GGUF rows of ``row_bytes`` bytes (W bytes, W16 the same memory as half-words)."""
    G: tl.constexpr = BLOCK_K // 32
    t = k0 // 32 + tl.arange(0, G)[:, None, None]  # the row's 32-weight group
    l = tl.arange(0, 32)[None, :, None]  # noqa: E741  (the weight within its group)
    mask = (t < k_end // 32) & n_mask[None, None, :]
    if FMT < 3:  # one block per group: d (fp16) [m (fp16)] then the quants
        base = n[None, None, :] * row_bytes + t * BYTES
        d = _half(W16, base, mask)
        if FMT == 0:  # 32 signed bytes
            q = tl.load(W + base + 2 + l, mask=mask, other=0).to(tl.int32)
            w = (((q & 255) ^ 128) - 128).to(tl.float32) * d
        else:  # byte l % 16: weight l % 16 in its low nibble, l % 16 + 16 in its high one
            qs = 4 if FMT == 2 else 2
            q = (tl.load(W + base + qs + l % 16, mask=mask, other=0).to(tl.int32) >> (4 * (l // 16))) & 15
            if FMT == 1:
                w = (q.to(tl.float32) - 8.0) * d
            else:
                w = q.to(tl.float32) * d + _half(W16, base + 2, mask)
    else:  # a 256-weight super-block holds 8 groups
        base = n[None, None, :] * row_bytes + (t // 8) * BYTES
        s = t % 8
        if FMT < 5:  # Q4_K / Q5_K: group s is byte run s // 2, low nibbles for even s; d, dmin, 6-bit scale / min
            q_lo, q_hi = q45_k_quants(W, base, s // 2, l, mask, FMT == 4)
            sc, m = q4_k_scale_min(W, base, s, mask)
            q = tl.where(s % 2 == 0, q_lo, q_hi).to(tl.float32)
            w = (_half(W16, base, mask) * sc) * q - _half(W16, base + 2, mask) * m
        else:  # Q6_K: weight 32 s + l is ql byte 64 (s // 4) + 32 (s % 2) + l's low (s % 4 < 2) or high nibble
            h = s // 4
            q_lo, q_hi = q6_k_quants(W, base, h, 32 * (s % 2) + l, mask)
            q = tl.where(s % 4 < 2, q_lo, q_hi)
            sc = tl.load(W + base + 192 + 8 * h + 2 * (s % 4) + l // 16, mask=mask, other=0).to(tl.int32)
            sc = (((sc & 255) ^ 128) - 128).to(tl.float32)  # one int8 scale per 16 weights
            w = (_half(W16, base + 208, mask) * sc) * q
    return tl.reshape(w, [BLOCK_K, n.shape[0]])


@triton.jit
def _gemm_gguf_kernel(
    X, U, W, W16, B, Y, WS, CNT, M, N, K, sx_m, su_m, sy_m, row_bytes, k_per_split,
    SWIGLU: tl.constexpr, FMT: tl.constexpr, BYTES: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask, r_mask = cols < N, rows < M
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        a = load_a(X, U, rows, r_mask, k0, k_end, sx_m, su_m, SWIGLU, BLOCK_K)
        w = gguf_tile(W, W16, k0, k_end, cols, n_mask, row_bytes, FMT, BYTES, BLOCK_K)
        acc = dot_acc(acc, a, w, X.dtype.element_ty, UPCAST)
    store_tile(acc, Y, B, WS, CNT, rows, cols, r_mask, n_mask, M, N, sy_m, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)


def gemm_gguf(x, up, qw, bias=None, tiles=None, split=None, options=DEFAULT):
    """x [M, K] (the gate with ``up`` [M, K] for SwiGLU; unit column stride) @ dequantize(qw).T -> [M, N] in x's
    dtype (+ bias). ``tiles``: (block_m, block_n, block_k, num_warps, num_stages), or without block_m; block_k a
    multiple of 32 (K-quants: of 256 is not needed, K is)."""
    n, k = qw.shape
    m = x.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = tiles_for(qw.format, m, tiles, x.device, options)
    assert block_k % 32 == 0 and k % 32 == 0
    grid, per, split = launch_plan(m, n, k, x.device, (block_m, block_n, block_k), split)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = workspace(split, m, n, x.device)
    cnt = counters(x.device, grid[0] * grid[1]) if split > 1 else ws  # only split launches count tiles
    w = qw.qweight
    if w.stride(-1) != 1 or w.stride(0) % 2:
        w = w.contiguous()
    u = up if up is not None else x
    _gemm_gguf_kernel[grid](
        x, u, w.view(torch.uint8), w.view(torch.int16), bias if bias is not None else y, y, ws, cnt, m, n, k,
        x.stride(0), u.stride(0), y.stride(0), w.stride(0), per,
        SWIGLU=up is not None, FMT=CODES[qw.format], BYTES=GGUF_BYTES[qw.format], HAS_BIAS=bias is not None,
        UPCAST=INTERPRET or x.dtype == torch.float32, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y
