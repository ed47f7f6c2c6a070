"""One-row GEMV on 1-byte weights with scales: int8 and fp8 (e4m3) per channel, fp8 per 1x128 block.

y[n] = sum_k x[k] * w[n, k] * s[n]  (per channel: the scale applied once per row at the end)
y[n] = sum_b s[n, b] * sum_{k in block b} x[k] * w[n, k]  (blocks: GROUP = 128 weights of a row per scale)

Each program owns BLOCK_N rows and reads their [BLOCK_N, K] slice of the weight once, converting it to float32 in
the load (fp8 through the GPU's conversion, or by bit arithmetic where it has none: FP8_BITS), accumulating in
float32, rounding once. SWIGLU folds silu(gate) * up into the activation load. SPLIT > 1 splits K over programs that
add float32 partial sums atomically (the wrapper adds the bias and rounds). Inference only.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._qgemv import (
    TILES,
    dense_rows,
    e4m3_to_f32,
    finish,
    load_x,
    no_fp8_cvt,
    output,
    split_k,
    store_out,
)


@triton.jit
def _gemv_scaled_kernel(
    X, U, W, S, B, Y, N, K, sw_n, ss_n, k_per_split,
    SWIGLU: tl.constexpr, GROUP: tl.constexpr, FP8_BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    kk = tl.arange(0, BLOCK_K)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + kk
        k_mask = k < k_end
        x = load_x(X, U, k, k_mask, SWIGLU)
        w = tl.load(W + n[:, None] * sw_n + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if FP8_BITS:
            w = e4m3_to_f32(w)
        else:
            w = w.to(tl.float32)
        if GROUP == 0:
            acc2 += w * x[None, :]
        else:
            s = tl.load(S + n * ss_n + k0 // GROUP, mask=n_mask, other=0.0)
            acc += tl.sum(w * x[None, :], axis=1) * s
    if GROUP == 0:
        acc = tl.sum(acc2, axis=1) * tl.load(S + n, mask=n_mask, other=0.0)
    store_out(Y, B, n, n_mask, acc, HAS_BIAS, SPLIT)


def gemv_scaled(x, up, qw, bias=None, tiles=None, split=None, fp8_bits=None):
    """x [1, K] (the gate with ``up`` for SwiGLU) @ dequantize(qw).T -> [1, N] in x's dtype (+ bias)."""
    n, k = qw.shape
    block_n, block_k, num_warps, num_stages = tiles or TILES[qw.format]
    group = 128 if qw.format == "fp8_block" else 0
    if group:
        block_k = min(block_k, group)
    w, scales = dense_rows(qw.qweight), dense_rows(qw.scales)
    fp8 = qw.format != "int8"
    if fp8_bits is None:
        fp8_bits = fp8 and no_fp8_cvt(w.device)
    if fp8_bits:
        w = w.view(torch.uint8)
    grid_n = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = split or split_k(grid_n, k_tiles, w.device)
    per = triton.cdiv(k_tiles, split) * block_k
    split = triton.cdiv(k, per)
    y = output(1, n, x.dtype, x.device, split)
    _gemv_scaled_kernel[(grid_n, split)](
        x, up if up is not None else x, w, scales, bias if bias is not None else y, y, n, k, w.stride(0),
        scales.stride(0), per,
        SWIGLU=up is not None, GROUP=group, FP8_BITS=bool(fp8_bits), HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return finish(y, bias, x.dtype, split)
