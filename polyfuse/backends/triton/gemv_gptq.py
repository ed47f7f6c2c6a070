"""One-row GEMV on int4 weights in AutoGPTQ's layout (polyfuse/ops/quant_formats.py), dequantized in the loads.

qweight int32 [K/8, N] holds weight k of column n in bits 4 (k % 8) of word [k // 8, n]; each program owns BLOCK_N
columns (contiguous words) and walks K in tiles of BLOCK_K8 words x 8 nibbles. Groups in order (g_idx = k // G):
a tile lies in one group (BLOCK_K8 * 8 divides G), so one scale and zero per column per tile. The tile's products
(q - z) * x go into a [BLOCK_K8, BLOCK_N] float32 accumulator, scaled per tile and summed over K once at the end
(a cross-thread sum per nibble and tile made the first version 10x slower than the memory allows on an H200: 70
tokens/s for the 8B shape). A nibble becomes a float without the slow int -> float conversion: OR-ed into the
mantissa of 2^23 and bit-cast, the zero point (and 2^23) subtracted in one float op. Act-order checkpoints
(ACT_ORDER: any g_idx) gather scale and zero per weight.
SWIGLU folds silu(gate) * up into the activation load; SPLIT > 1 splits K (float32 atomic partial sums).
"""

import triton
import triton.language as tl

from polyfuse.backends.triton._qgemv import TILES, dense_rows, finish, load_x, output, split_k, store_out


@triton.jit
def _gemv_gptq_kernel(
    X, U, QW, QZ, S, GI, B, Y, N, K8, G_SIZE, sq_k, sz_g, ss_g, k8_per_split,
    SWIGLU: tl.constexpr, ACT_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    zshift = (n % 8) * 4
    k8_start = tl.program_id(1) * k8_per_split
    k8_end = tl.minimum(K8, k8_start + k8_per_split)
    kk8 = tl.arange(0, BLOCK_K8)
    acc2 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    for k80 in range(k8_start, k8_end, BLOCK_K8):
        k8 = k80 + kk8
        k_mask = k8 < k8_end
        m2 = k_mask[:, None] & n_mask[None, :]
        words = tl.load(QW + k8[:, None] * sq_k + n[None, :], mask=m2, other=0)
        if ACT_ORDER:
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
            g = (k80 * 8) // G_SIZE
            s = tl.load(S + g * ss_g + n, mask=n_mask, other=0.0).to(tl.float32)
            zw = tl.load(QZ + g * sz_g + n // 8, mask=n_mask, other=0)
            # 2^23 + q as a float is q's bits OR-ed into 2^23's mantissa; minus (2^23 + z): q - z, exact.
            off = (((zw >> zshift) & 15) + 1).to(tl.float32) + 8388608.0
            t = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
            for i in tl.static_range(8):
                x = load_x(X, U, k8 * 8 + i, k_mask, SWIGLU)
                q = (((words >> (4 * i)) & 15) | 0x4B000000).to(tl.float32, bitcast=True)
                t += (q - off[None, :]) * x[:, None]
            acc2 += t * s[None, :]
    acc = tl.sum(acc2, axis=0)
    store_out(Y, B, n, n_mask, acc, HAS_BIAS, SPLIT)


def gemv_gptq(x, up, qw, bias=None, tiles=None, split=None):
    """x [1, K] (the gate with ``up`` for SwiGLU) @ dequantize(qw).T -> [1, N] in x's dtype (+ bias)."""
    n, k = qw.shape
    block_n, block_k, num_warps, num_stages = tiles or TILES["int4"]
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
    y = output(1, n, x.dtype, x.device, split)
    qweight, qzeros, scales, g_idx = (dense_rows(t) for t in (qw.qweight, qw.qzeros, qw.scales, qw.g_idx))
    _gemv_gptq_kernel[(grid_n, split)](
        x, up if up is not None else x, qweight, qzeros, scales, g_idx, bias if bias is not None else y,
        y, n, k8, qw.group_size, qweight.stride(0), qzeros.stride(0), scales.stride(0), per,
        SWIGLU=up is not None, ACT_ORDER=act_order, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, BLOCK_K8=block_k8, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return finish(y, bias, x.dtype, split)
