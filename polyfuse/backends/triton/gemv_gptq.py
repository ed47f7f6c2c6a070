"""One-row GEMV on int4 weights in AutoGPTQ's layout (polyfuse/ops/quant_formats.py), dequantized in the loads.

qweight int32 [K/8, N] holds weight k of column n in bits 4 (k % 8) of word [k // 8, n]; each program owns BLOCK_N
columns (contiguous words) and walks K in tiles of BLOCK_K8 words x 8 nibbles. Groups in order (g_idx = k // G):
a tile lies in one group (BLOCK_K8 * 8 divides G), so one scale and zero per column per tile. The tile's products
go into a [BLOCK_K8, BLOCK_N] float32 accumulator, scaled per tile and summed over K once at the end (a cross-thread
sum per nibble and tile made the first version 10x slower than the memory allows on an H200).

A nibble becomes a float in one integer op and one float op, without the quarter-rate int -> float conversion and
without shifting it down: nibble i of a word, masked in place (bits 4i..4i+3, i < 5; the last three from the word
shifted right by 12) and OR-ed into the mantissa of 2^23, bit-cast, minus 2^23, is q * 2^(4i) exactly; the
activation it multiplies was scaled by 2^-4i once per row, so the product is q * x with one rounding. The zero point
leaves the inner loop: sum q x - z sum x per column and tile. The K loop is software-pipelined
(``tl.range(num_stages=STAGES)``; Triton does not pipeline a plain loop whose loads feed no tl.dot). Act-order checkpoints (ACT_ORDER: any g_idx)
gather scale and zero per weight. SWIGLU folds silu(gate) * up into the activation load; SPLIT > 1 splits K over
programs whose partial sums the last one adds (_qgemv.store_out).
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._qgemv import dense_rows, load_x, split_buffers, split_k, store_out, tiles_for


@triton.jit
def _gemv_gptq_kernel(
    X, U, QW, QZ, S, GI, B, Y, WS, CNT, N, K8, G_SIZE, sq_k, sz_g, ss_g, k8_per_split,
    SWIGLU: tl.constexpr, ACT_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    zshift = (n % 8) * 4
    k8_start = tl.program_id(1) * k8_per_split
    k8_end = tl.minimum(K8, k8_start + k8_per_split)
    kk8 = tl.arange(0, BLOCK_K8)
    acc2 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    if ACT_ORDER:
        for k80 in range(k8_start, k8_end, BLOCK_K8):
            k8 = k80 + kk8
            k_mask = k8 < k8_end
            m2 = k_mask[:, None] & n_mask[None, :]
            words = tl.load(QW + k8[:, None] * sq_k + n[None, :], mask=m2, other=0)
            for i in tl.static_range(8):
                k = k8 * 8 + i
                x = load_x(X, U, k, k_mask, SWIGLU)
                g = tl.load(GI + k, mask=k_mask, other=0).to(tl.int64)
                s = tl.load(S + g[:, None] * ss_g + n[None, :], mask=m2, other=0.0).to(tl.float32)
                zw = tl.load(QZ + g[:, None] * sz_g + n[None, :] // 8, mask=m2, other=0)
                z = ((zw >> zshift[None, :]) & 15) + 1
                q = (words >> (4 * i)) & 15
                acc2 += (q - z).to(tl.float32) * s * x[:, None]
    else:
        for k80 in tl.range(k8_start, k8_end, BLOCK_K8, num_stages=STAGES):
            k8 = k80 + kk8
            k_mask = k8 < k8_end
            words = tl.load(QW + k8[:, None] * sq_k + n[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0)
            g = (k80 * 8) // G_SIZE
            s = tl.load(S + g * ss_g + n, mask=n_mask, other=0.0).to(tl.float32)
            zw = tl.load(QZ + g * sz_g + n // 8, mask=n_mask, other=0)
            z = (((zw >> zshift) & 15) + 1).to(tl.float32)
            high = words >> 12  # nibbles 5..7 at bits 8..19 (the sign-filled bits above are masked off)
            t = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
            xs = tl.zeros([BLOCK_K8], dtype=tl.float32)
            for i in tl.static_range(8):
                x = load_x(X, U, k8 * 8 + i, k_mask, SWIGLU)
                xs += x
                if i < 5:
                    q = ((words & (15 << (4 * i))) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    # (q 2^4i) (x 2^-4i): q x, exact but for the one rounding
                    t += q * (x * (1.0 / (1 << (4 * i))))[:, None]
                else:
                    q = ((high & (15 << (4 * i - 12))) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    t += q * (x * (1.0 / (1 << (4 * i - 12))))[:, None]
            acc2 += (t - z[None, :] * xs[:, None]) * s[None, :]
    acc = tl.sum(acc2, axis=0)
    store_out(Y, B, WS, CNT, n, n_mask, N, acc, HAS_BIAS, SPLIT)


def gemv_gptq(x, up, qw, bias=None, tiles=None, split=None):
    """x [1, K] (the gate with ``up`` for SwiGLU) @ dequantize(qw).T -> [1, N] in x's dtype (+ bias)."""
    n, k = qw.shape
    block_n, block_k, num_warps, num_stages = tiles or tiles_for("int4", n, k)
    block_k8 = 1 << (max(1, block_k // 8).bit_length() - 1)
    act_order = bool(qw.act_order)
    if qw.group_size < k:  # a tile must lie inside one group: 8 * block_k8 divides the group size
        while block_k8 > 1 and qw.group_size % (8 * block_k8):
            block_k8 //= 2
        act_order = act_order or qw.group_size % 8 != 0  # no such tile: gather the group of every weight
    k8 = k // 8
    grid_n = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k8, block_k8)
    split = split or split_k(grid_n, k_tiles, x.device)
    per = triton.cdiv(k_tiles, split) * block_k8
    split = triton.cdiv(k8, per)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    ws, cnt = split_buffers(split, grid_n, n, x.device)
    qweight, qzeros, scales, g_idx = (dense_rows(t) for t in (qw.qweight, qw.qzeros, qw.scales, qw.g_idx))
    _gemv_gptq_kernel[(grid_n, split)](
        x, up if up is not None else x, qweight, qzeros, scales, g_idx, bias if bias is not None else y,
        y, ws, cnt, n, k8, qw.group_size, qweight.stride(0), qzeros.stride(0), scales.stride(0), per,
        SWIGLU=up is not None, ACT_ORDER=act_order, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, BLOCK_K8=block_k8, STAGES=num_stages, num_warps=num_warps, num_stages=num_stages,
        **pdl_options(x.device),
    )  # fmt: skip
    return y
