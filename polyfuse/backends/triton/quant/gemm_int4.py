"""Dequantizing GEMM on int4 weights in AutoGPTQ's layout (polyfuse/ops/quant_formats.py), for a few rows (batch
decode: M of about 2 to 64).

y[M, N] = x[M, K] @ w[K, N], w[k, n] = (q[k, n] - (z[g, n] + 1)) * s[g, n], g the group of k. Grid (N tiles, M tiles,
K splits); each program owns a [BLOCK_M, BLOCK_N] output tile (BLOCK_M covers every row of a decode batch, so each
packed weight byte is read once per call) and walks its share of K in BLOCK_K steps: the packed words of the step
(qweight int32 [K/8, N]: BLOCK_K / 8 words per column), one scale and zero per column (the step lies in one group;
act-order g_idx: gathered per weight), dequantized in registers to float32, rounded to the activations' dtype, then
a tensor-core tl.dot with the activation tile, accumulated in float32. SWIGLU folds silu(gate) * up into the
activation loads (the down projection). SPLIT > 1 splits K over programs; the tile's last program adds the float32
partials (gemm_common.store_tile), so a call is one launch. Inference only.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import INTERPRET  # the interpreter has no bfloat16 dot: float32 products
from polyfuse.backends.triton.quant.gemm_common import (
    dot_acc,
    int4_tile,
    launch_plan,
    load_a,
    store_tile,
    tiles_for,
)
from polyfuse.backends.triton.quant.gemv_common import counters, dense_rows, workspace
from polyfuse.core.kernel_options import DEFAULT


@triton.jit
def _gemm_gptq_kernel(
    X, U, QW, QZ, S, GI, B, Y, WS, CNT, M, N, K, G_SIZE, sx_m, su_m, sy_m, sq_k, sz_g, ss_g, k_per_split,
    SWIGLU: tl.constexpr, GATHER: tl.constexpr, RESHAPE: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask, r_mask = cols < N, rows < M
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        a = load_a(X, U, rows, r_mask, k0, k_end, sx_m, su_m, SWIGLU, BLOCK_K)
        w = int4_tile(QW, QZ, S, GI, k0, k_end, cols, n_mask, k0 // G_SIZE, sq_k, sz_g, ss_g,
                      GATHER, RESHAPE, BLOCK_K, BLOCK_N)  # fmt: skip
        acc = dot_acc(acc, a, w, X.dtype.element_ty, UPCAST)
    store_tile(acc, Y, B, WS, CNT, rows, cols, r_mask, n_mask, M, N, sy_m, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)


def int4_block_k(qw, block_k: int) -> tuple[int, bool]:
    """(block_k, gather): the largest power-of-two step up to ``block_k`` (at least 16, a tl.dot minimum) inside one
    group; gather the group of every weight when the checkpoint is act-order or no such step exists."""
    n, k = qw.shape
    gather = bool(qw.act_order)
    if not gather and qw.group_size < k:
        while block_k > 16 and qw.group_size % block_k:
            block_k //= 2
        gather = qw.group_size % block_k != 0
    return block_k, gather


def gemm_int4(x, up, qw, bias=None, tiles=None, split=None, reshape=False, options=DEFAULT):
    """x [M, K] (the gate with ``up`` [M, K] for SwiGLU; unit column stride) @ dequantize(qw).T -> [M, N] in x's
    dtype (+ bias). ``tiles``: (block_m, block_n, block_k, num_warps, num_stages), or without block_m; ``reshape``:
    unpack each word once and expand it in registers (gemm_common.int4_tile; measured, not faster)."""
    n, k = qw.shape
    m = x.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = tiles_for("int4", m, tiles, x.device, options)
    block_k, gather = int4_block_k(qw, block_k)
    grid, per, split = launch_plan(m, n, k, x.device, (block_m, block_n, block_k), split)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = workspace(split, m, n, x.device)
    cnt = counters(x.device, grid[0] * grid[1]) if split > 1 else ws  # only split launches count tiles
    qweight, qzeros, scales, g_idx = (dense_rows(t) for t in (qw.qweight, qw.qzeros, qw.scales, qw.g_idx))
    u = up if up is not None else x
    _gemm_gptq_kernel[grid](
        x, u, qweight, qzeros, scales, g_idx, bias if bias is not None else y, y, ws, cnt, m, n, k,
        qw.group_size, x.stride(0), u.stride(0), y.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0),
        per,
        SWIGLU=up is not None, GATHER=gather, RESHAPE=bool(reshape),
        HAS_BIAS=bias is not None, UPCAST=INTERPRET or x.dtype == torch.float32, SPLIT=split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y
