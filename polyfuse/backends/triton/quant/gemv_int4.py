"""One-row GEMV on int4 weights in AutoGPTQ's layout (polyfuse/ops/quant_formats.py), dequantized in the loads.

qweight int32 [K/8, N] holds weight k of column n in bits 4 (k % 8) of word [k // 8, n]; each program owns BLOCK_N
columns (contiguous words) and walks K in tiles of BLOCK_K8 words x 8 nibbles. Groups in order (g_idx = k // G):
a tile lies in one group (BLOCK_K8 * 8 divides G), so one scale and zero per column per tile. The tile's products
go into a [BLOCK_K8, BLOCK_N] float32 accumulator, scaled per tile and summed over K once at the end (a cross-thread
sum per nibble and tile made the first version 10x slower than the memory allows on an H200).

A nibble becomes a float without the quarter-rate int -> float conversion and without a subtraction: the word's
even and odd nibbles are masked into bits 3..6 of each byte (a shift and an and per word each), and one byte permute
per weight sets beside the exponent byte of 2.0, so the bit-cast float is 2 + q / 8 exactly; one FMA per weight adds
(2 + q / 8) x into the tile's sum t (compiled for sm_90 the loop went from 6.9 to 3.7-4.5 instructions per weight). Per group
s (sum q x - z sum x) = 8 s t - (16 + z) s sum x: the tile's t is scaled by its column's s, and the second term is
taken once per group and column after the loop, from the group's activation sum over the program's K range. The
K loop is software-pipelined (``tl.range(num_stages=STAGES)``; Triton does not pipeline a plain loop whose loads
feed no tl.dot). Act-order checkpoints (ACT_ORDER: any g_idx) gather scale and zero per weight. SWIGLU folds silu(gate) * up into the activation load; SPLIT > 1 splits K over
programs whose partial sums the last one adds (gemv_common.store_out).
"""

import functools

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._rounding import PTX
from polyfuse.backends.triton.quant.gemv_common import (
    dense_rows,
    gemv_tiles,
    int4_group_term,
    int4_tail_unroll,
    load_x,
    split_buffers,
    split_plan,
    store_out,
    weight_tile,
)
from polyfuse.core.kernel_options import DEFAULT


@triton.jit
def _nibbles_f32(words, ASM: tl.constexpr):
    """The eight nibbles q of each int32 word (weight k8 * 8 + i in bits 4i..4i+3) as the exact float32 2 + q / 8:
    the nibble under the exponent of 2.0 as the top four mantissa bits. ASM: the even and the odd nibbles masked into
    bits 3..6 of each byte (a shift and an and per word each), then one byte permute per weight beside the exponent
    byte 0x40; no add, no per-nibble mask constant (the kernel takes q x from (2 + q / 8) x once per group). Else the
    same numbers in Triton arithmetic (the CPU interpreter, ROCm)."""
    if ASM:
        b0, b1, b2, b3, b4, b5, b6, b7 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 e, o, m;
            shl.b32 e, $8, 3;
            and.b32 e, e, 0x78787878;
            shr.u32 o, $8, 1;
            and.b32 o, o, 0x78787878;
            mov.b32 m, 0x40000000;
            prmt.b32 $0, e, m, 0x7044;
            prmt.b32 $1, o, m, 0x7044;
            prmt.b32 $2, e, m, 0x7144;
            prmt.b32 $3, o, m, 0x7144;
            prmt.b32 $4, e, m, 0x7244;
            prmt.b32 $5, o, m, 0x7244;
            prmt.b32 $6, e, m, 0x7344;
            prmt.b32 $7, o, m, 0x7344;
            }""",
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[words],
            dtype=(tl.int32,) * 8,
            is_pure=True,
            pack=1,
        )
    else:
        b0 = ((words & 15) << 19) | 0x40000000
        b1 = (((words >> 4) & 15) << 19) | 0x40000000
        b2 = (((words >> 8) & 15) << 19) | 0x40000000
        b3 = (((words >> 12) & 15) << 19) | 0x40000000
        b4 = (((words >> 16) & 15) << 19) | 0x40000000
        b5 = (((words >> 20) & 15) << 19) | 0x40000000
        b6 = (((words >> 24) & 15) << 19) | 0x40000000
        b7 = (((words >> 28) & 15) << 19) | 0x40000000
    return (
        b0.to(tl.float32, bitcast=True), b1.to(tl.float32, bitcast=True), b2.to(tl.float32, bitcast=True),
        b3.to(tl.float32, bitcast=True), b4.to(tl.float32, bitcast=True), b5.to(tl.float32, bitcast=True),
        b6.to(tl.float32, bitcast=True), b7.to(tl.float32, bitcast=True),
    )  # fmt: skip


@triton.jit
def _words(QW, k8, k8_end, n, n_mask, sq_k, EARLY: tl.constexpr):
    """The packed words of rows k8 (those < k8_end) and columns n; EARLY: loaded before the PDL wait, past L1."""
    return weight_tile(QW + k8[:, None] * sq_k + n[None, :], (k8 < k8_end)[:, None] & n_mask[None, :], 0, EARLY)


@triton.jit
def _tile_sum(words, X, U, S, k80, k8, k_mask, n, s_mask, G_SIZE, ss_g, SWIGLU: tl.constexpr, ASM: tl.constexpr):
    """One [BLOCK_K8, BLOCK_N] tile of words starting at word row k80 (inside one group): sum_i (2 + q_i / 8) x_i
    per word, times the group's scale of each column (s_mask: the columns whose scale is read)."""
    s = tl.load(S + ((k80 * 8) // G_SIZE) * ss_g + n, mask=s_mask, other=0.0).to(tl.float32)
    q0, q1, q2, q3, q4, q5, q6, q7 = _nibbles_f32(words, ASM)
    t = q0 * load_x(X, U, k8 * 8, k_mask, SWIGLU)[:, None]
    t += q1 * load_x(X, U, k8 * 8 + 1, k_mask, SWIGLU)[:, None]
    t += q2 * load_x(X, U, k8 * 8 + 2, k_mask, SWIGLU)[:, None]
    t += q3 * load_x(X, U, k8 * 8 + 3, k_mask, SWIGLU)[:, None]
    t += q4 * load_x(X, U, k8 * 8 + 4, k_mask, SWIGLU)[:, None]
    t += q5 * load_x(X, U, k8 * 8 + 5, k_mask, SWIGLU)[:, None]
    t += q6 * load_x(X, U, k8 * 8 + 6, k_mask, SWIGLU)[:, None]
    t += q7 * load_x(X, U, k8 * 8 + 7, k_mask, SWIGLU)[:, None]
    return t * s[None, :]


@triton.jit
def _gemv_gptq_kernel(
    X, U, QW, QZ, S, GI, B, Y, WS, CNT, N, K8, G_SIZE, sq_k, sz_g, ss_g, k8_per_split,
    SWIGLU: tl.constexpr, ACT_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT,
    BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
    ASM: tl.constexpr, XBLOCK: tl.constexpr, PRE: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    zshift = (n % 8) * 4
    k8_start = tl.program_id(1) * k8_per_split
    k8_end = tl.minimum(K8, k8_start + k8_per_split)
    kk8 = tl.arange(0, BLOCK_K8)
    acc2 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    # PRE (0..2) tiles of weights loaded before the PDL wait (no kernel before this one writes them, and they bypass
    # L1): they stream while the kernel before still runs; summed after it, in the same order as the loop would (a
    # tile wholly past the split's end reads no scale: its group may lie past the last)
    k8a = k8_start + kk8
    k8b = k8a + BLOCK_K8
    tl.static_assert(PRE == 0 or not ACT_ORDER, "act-order gathers its groups per weight: no early tiles")
    if PRE >= 1:
        wa = _words(QW, k8a, k8_end, n, n_mask, sq_k, True)
    if PRE >= 2:
        wb = _words(QW, k8b, k8_end, n, n_mask, sq_k, True)
    wait_prior(PDL)
    if PRE >= 1:
        acc2 += _tile_sum(wa, X, U, S, k8_start, k8a, k8a < k8_end, n, n_mask, G_SIZE, ss_g, SWIGLU, ASM)
    if PRE >= 2:
        live = n_mask & (n * 0 + k8_start + BLOCK_K8 < k8_end)
        acc2 += _tile_sum(wb, X, U, S, k8_start + BLOCK_K8, k8b, k8b < k8_end, n, live, G_SIZE, ss_g, SWIGLU, ASM)
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
        acc = tl.sum(acc2, axis=0)
    else:
        for k80 in tl.range(k8_start + PRE * BLOCK_K8, k8_end, BLOCK_K8, num_stages=STAGES):
            k8 = k80 + kk8
            k_mask = k8 < k8_end
            words = _words(QW, k8, k8_end, n, n_mask, sq_k, False)
            acc2 += _tile_sum(words, X, U, S, k80, k8, k_mask, n, n_mask, G_SIZE, ss_g, SWIGLU, ASM)
        # t = sum (2 + q / 8) x per tile, so a group's s (sum q x - z sum x) = 8 s t - (16 + z) s sum x: the second
        # term per group from the group's activation sum (this split's part of it), once per column
        corr = tl.zeros([BLOCK_N], dtype=tl.float32)
        k_lo = k8_start * 8
        k_hi = k8_end * 8
        xb = tl.arange(0, XBLOCK)
        for g in range(k_lo // G_SIZE, tl.cdiv(k_hi, G_SIZE)):
            g_lo = tl.maximum(g * G_SIZE, k_lo)
            g_hi = tl.minimum(g * G_SIZE + G_SIZE, k_hi)
            xg = tl.zeros([XBLOCK], dtype=tl.float32)
            for c in range(g_lo, g_hi, XBLOCK):
                xg += load_x(X, U, c + xb, c + xb < g_hi, SWIGLU)
            corr += int4_group_term(S, QZ, g, n, n_mask, zshift, ss_g, sz_g) * tl.sum(xg, axis=0)
        acc = 8.0 * tl.sum(acc2, axis=0) - corr
    store_out(Y, B, WS, CNT, n, n_mask, N, acc, HAS_BIAS, SPLIT, UNROLL)


def _plan(table, shape, group_size: int, act_order: bool, tiles=None):
    """(block_n, block_k8, num_warps, num_stages, act_order) of a launch on an [N, K] int4 weight."""
    n, k = shape
    block_n, block_k, num_warps, num_stages = tiles or table.tile("int4", n, k)
    block_k8 = 1 << (max(1, block_k // 8).bit_length() - 1)
    if group_size < k:  # a tile must lie inside one group: 8 * block_k8 divides the group size
        while block_k8 > 1 and group_size % (8 * block_k8):
            block_k8 //= 2
        act_order = act_order or group_size % 8 != 0  # no such tile: gather the group of every weight
    return block_n, block_k8, num_warps, num_stages, act_order


def _early_tiles(table, dense: bool, block_n, block_k8, num_warps, act_order) -> int:
    """Weight tiles each program loads before its PDL wait: none with act-order or for a weight the launcher first
    copies into dense rows (a copy made just now), else the table's prefetch count."""
    if act_order or not dense:
        return 0
    return table.prefetch("int4", block_k8 * block_n / (32 * num_warps))


@functools.lru_cache(maxsize=None)
def _loads_early(table, shape, group_size: int, act_order: bool, dense: bool) -> bool:
    block_n, block_k8, num_warps, _, act_order = _plan(table, shape, group_size, act_order)
    return _early_tiles(table, dense, block_n, block_k8, num_warps, act_order) > 0


def loads_early(qw, options=DEFAULT) -> bool:
    """Whether a one-row launch on ``qw`` loads weights before its PDL wait (what the norm / SwiGLU pairs are for);
    asked on every decode call of those ops, so answered once per weight shape, layout and tile table."""
    dense = dense_rows(qw.qweight) is qw.qweight
    table = gemv_tiles(qw.qweight.device, options)
    return _loads_early(table, tuple(qw.shape), qw.group_size, bool(qw.act_order), dense)


def gemv_int4(x, up, qw, bias=None, tiles=None, split=None, options=DEFAULT):
    """x [1, K] (the gate with ``up`` for SwiGLU) @ dequantize(qw).T -> [1, N] in x's dtype (+ bias)."""
    n, k = qw.shape
    table = gemv_tiles(x.device, options)
    block_n, block_k8, num_warps, num_stages, act_order = _plan(
        table, qw.shape, qw.group_size, bool(qw.act_order), tiles
    )
    k8 = k // 8
    grid_n = triton.cdiv(n, block_n)
    per_sm = table.programs_per_sm("int4", n, k)
    split, per = split_plan(grid_n, k8, block_k8, x.device, split, per_sm)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    ws, cnt = split_buffers(split, grid_n, n, x.device)
    qweight, qzeros, scales, g_idx = (dense_rows(t) for t in (qw.qweight, qw.qzeros, qw.scales, qw.g_idx))
    pre = _early_tiles(table, qweight is qw.qweight, block_n, block_k8, num_warps, act_order)
    _gemv_gptq_kernel[(grid_n, split)](
        x, up if up is not None else x, qweight, qzeros, scales, g_idx, bias if bias is not None else y,
        y, ws, cnt, n, k8, qw.group_size, qweight.stride(0), qzeros.stride(0), scales.stride(0), per,
        SWIGLU=up is not None, ACT_ORDER=act_order, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, BLOCK_K8=block_k8, STAGES=num_stages, ASM=PTX, XBLOCK=128, PRE=pre,
        UNROLL=int4_tail_unroll(block_n, num_warps, per_sm), num_warps=num_warps, num_stages=num_stages,
        **pdl_options(x.device, options),
    )  # fmt: skip
    return y
