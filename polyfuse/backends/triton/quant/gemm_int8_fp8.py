"""Dequantizing GEMM on per-channel 1-byte weights, int8 and fp8 e4m3 (polyfuse/ops/quant_formats.py), for a few
rows (batch decode: M of about 2 to 64).

y[M, N] = x[M, K] @ w[K, N], w[k, n] = q[n, k] * s[n] (qweight int8 or float8_e4m3fn [N, K], scales float32 [N]).
Grid (N tiles, M tiles, K splits); each program owns a [BLOCK_M, BLOCK_N] output tile (BLOCK_M covers every row of a
decode batch, so each weight byte is read once per call) and walks its share of K in BLOCK_K steps: the byte tile
(fp8 through the GPU's conversion, or by bit arithmetic where it has none), times the columns' scales (loaded once)
in float32, rounded to the activations' dtype as the reference's dequantized weight,
then a tensor-core tl.dot with the activation tile, accumulated in float32. SWIGLU folds silu(gate) * up into the
activation loads; SPLIT > 1 splits K (the tile's last program adds the partials: one launch). Inference only.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import INTERPRET  # the interpreter has no bfloat16 dot: float32 products
from polyfuse.backends.triton.quant.gemm_common import (
    BYTE_KINDS,
    byte_tile,
    dot_acc,
    launch_plan,
    load_a,
    store_tile,
    tiles_for,
)
from polyfuse.backends.triton.quant.gemv_common import counters, dense_rows, no_fp8_cvt, workspace
from polyfuse.core.kernel_options import DEFAULT


@triton.jit
def _gemm_scaled_kernel(
    X, U, W, S, B, Y, WS, CNT, M, N, K, sx_m, su_m, sy_m, sw_n, k_per_split,
    SWIGLU: tl.constexpr, KIND: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask, r_mask = cols < N, rows < M
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    s = tl.load(S + cols, mask=n_mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        a = load_a(X, U, rows, r_mask, k0, k_end, sx_m, su_m, SWIGLU, BLOCK_K)
        w = byte_tile(W, s, k0, k_end, cols, n_mask, sw_n, KIND, BLOCK_K)
        acc = dot_acc(acc, a, w, X.dtype.element_ty, UPCAST)
    store_tile(acc, Y, B, WS, CNT, rows, cols, r_mask, n_mask, M, N, sy_m, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)


def gemm_int8_fp8(x, up, qw, bias=None, tiles=None, split=None, fp8_bits=None, options=DEFAULT):
    """x [M, K] (the gate with ``up`` [M, K] for SwiGLU; unit column stride) @ dequantize(qw).T -> [M, N] in x's
    dtype (+ bias). ``tiles``: (block_m, block_n, block_k, num_warps, num_stages), or without block_m; ``fp8_bits``
    decodes fp8 by integer arithmetic (default: on GPUs without fp8 conversions, before sm89)."""
    n, k = qw.shape
    m = x.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = tiles_for(qw.format, m, tiles, x.device, options)
    grid, per, split = launch_plan(m, n, k, x.device, (block_m, block_n, block_k), split)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = workspace(split, m, n, x.device)
    cnt = counters(x.device, grid[0] * grid[1]) if split > 1 else ws  # only split launches count tiles
    w, scales = dense_rows(qw.qweight), dense_rows(qw.scales)
    kind = BYTE_KINDS[qw.format]
    if kind and (fp8_bits if fp8_bits is not None else no_fp8_cvt(w.device)):
        w, kind = w.view(torch.uint8), BYTE_KINDS["fp8_bits"]
    u = up if up is not None else x
    _gemm_scaled_kernel[grid](
        x, u, w, scales, bias if bias is not None else y, y, ws, cnt, m, n, k, x.stride(0), u.stride(0),
        y.stride(0), w.stride(0), per,
        SWIGLU=up is not None, KIND=kind, HAS_BIAS=bias is not None, UPCAST=INTERPRET or x.dtype == torch.float32,
        SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y
