"""One-row GEMV on int4 weights in AutoGPTQ's layout times int8 activations (W4A8), on integer dot products.

Opt-in (the kernel option ``int4_a8``, core/kernel_options.py; ``accepts`` reads it per call): the activations are
quantized to int8 in blocks of 32 (polyfuse/ops/act_int8.py: the arithmetic and what it costs; act_int8.py here: the
kernels that write them, fused into the norm or SwiGLU before the projection), as llama.cpp's GPU kernels do for its
4-bit types. The one-row int4 GEMV with bf16 activations (gemv_int4.py) spends about four instructions per weight (a
byte permute and an FMA, the activation loads); here a block of 32 weights (four words) costs eight masks and eight
``dp4a`` (each word's even nibbles, masked in place, against the bytes of x_0, x_2, x_4, x_6; its odd ones, masked
in place as 16 q, against x_1, .., x_7; two int32 chains over the block), one multiply-add joining the chains, then
one conversion and two float multiplies for the block's scale d and the column's scale s: about 0.6 arithmetic
instructions per weight (the compiled sm_90 loop, with the pipeline's copies and the activation loads: 1.33).

A group's s (sum q x' - z sum x') with x' = q_x d: the tile's [BLOCK_K8 / 4, BLOCK_N] float32 accumulator takes
s d (sum q q_x) per block and column; the zero term once per group and column after the loop, from the blocks'
d sum q_x (RS). Tiles hold whole blocks and lie in one group (8 BLOCK_K8 divides the group size); act-order
checkpoints are declined (gemv_int4.py takes them). Split-K, the early weight tiles and the PDL wait as in
gemv_int4.py.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._rounding import PTX
from polyfuse.backends.triton.quant.act_int8 import takes_row
from polyfuse.backends.triton.quant.gemv_common import (
    dense_rows,
    gemv_tiles,
    int4_tail_unroll,
    int4_zero_scale,
    split_buffers,
    split_plan,
    store_out,
    weight_tile,
)
from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.act_int8 import takes


def _dot32_asm() -> str:
    """PTX for a block of 32 weights and activations (four words w_j = $1..$4, activation words xe_j = $5..$8 and
    xo_j = $9..$12): the even nibbles masked in place (w & 0x0F0F0F0F) into one dp4a chain, the odd ones masked in
    place (w & 0xF0F0F0F0: 16 q) into another; $0 = 16 * even + odd = 16 * sum q x, exact in int32."""
    lines = ["{", ".reg .b32 l, h, a, b;"]
    for j in range(4):
        acc_a, acc_b = ("0", "0") if j == 0 else ("a", "b")
        lines += [
            f"and.b32 l, ${1 + j}, 0x0F0F0F0F;",
            f"and.b32 h, ${1 + j}, 0xF0F0F0F0;",
            f"dp4a.u32.s32 a, l, ${5 + j}, {acc_a};",
            f"dp4a.u32.s32 b, h, ${9 + j}, {acc_b};",
        ]
    return "\n".join(lines + ["mad.lo.s32 $0, a, 16, b;", "}"])


_DOT32 = tl.constexpr(_dot32_asm())


@triton.jit
def _dot_word(w, xe, xo):
    """sum_i q_i x_i of one word in Triton arithmetic (the interpreter): q_i nibble i of w, x_i byte i // 2 of xe (i
    even) or xo (odd), signed."""
    acc = tl.zeros_like(w)
    for j in tl.static_range(4):
        acc += ((w >> (8 * j)) & 15) * ((xe << (24 - 8 * j)) >> 24)
        acc += ((w >> (8 * j + 4)) & 15) * ((xo << (24 - 8 * j)) >> 24)
    return acc


@triton.jit
def _dot32(w0, w1, w2, w3, e0, e1, e2, e3, o0, o1, o2, o3, ASM: tl.constexpr):
    """16 * sum q x over a block of 32 weights (words w0..w3, consecutive along K) and their int8 activations
    (xe / xo words e_j, o_j of word j); exact int32. ASM: 8 masks and 8 dp4a; else _dot_word four times."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm=_DOT32, constraints="=r" + ",r" * 12, args=[w0, w1, w2, w3, e0, e1, e2, e3, o0, o1, o2, o3],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return 16 * (_dot_word(w0, e0, o0) + _dot_word(w1, e1, o1) + _dot_word(w2, e2, o2) + _dot_word(w3, e3, o3))


@triton.jit
def _block_words(P, r, k8_end, n_mask, SQ_K: tl.constexpr, MASKED: tl.constexpr, EARLY: tl.constexpr):
    """The four word rows of each block of the tile at pointers P (rows r, the blocks' first, times columns):
    rows r .. r + 3, those < k8_end where MASKED (else every row and column is in range); EARLY: loaded before the
    PDL wait, past L1. The row stride SQ_K is a constant, so the four rows are one address plus offsets."""
    if MASKED:
        m = (r < k8_end)[:, None] & n_mask[None, :]
        w0 = weight_tile(P, m, 0, EARLY)
        w1 = weight_tile(P + SQ_K, m, 0, EARLY)
        w2 = weight_tile(P + 2 * SQ_K, m, 0, EARLY)
        w3 = weight_tile(P + 3 * SQ_K, m, 0, EARLY)
    else:
        w0 = weight_tile(P, None, None, EARLY)
        w1 = weight_tile(P + SQ_K, None, None, EARLY)
        w2 = weight_tile(P + 2 * SQ_K, None, None, EARLY)
        w3 = weight_tile(P + 3 * SQ_K, None, None, EARLY)
    return w0, w1, w2, w3


@triton.jit
def _tile_sum(w0, w1, w2, w3, XW, DX, S, k80, r, k8_end, n, s_mask, G_SIZE, ss_g, ASM: tl.constexpr):
    """One tile of blocks (first word rows r, from k80, inside one group): s d (sum q q_x) per block and column
    (s_mask: the columns whose scale is read)."""
    s = tl.load(S + ((k80 * 8) // G_SIZE) * ss_g + n, mask=s_mask, other=0.0).to(tl.float32)
    m = r < k8_end
    e0 = tl.load(XW + 2 * r, mask=m, other=0)[:, None]
    o0 = tl.load(XW + 2 * r + 1, mask=m, other=0)[:, None]
    e1 = tl.load(XW + 2 * r + 2, mask=m, other=0)[:, None]
    o1 = tl.load(XW + 2 * r + 3, mask=m, other=0)[:, None]
    e2 = tl.load(XW + 2 * r + 4, mask=m, other=0)[:, None]
    o2 = tl.load(XW + 2 * r + 5, mask=m, other=0)[:, None]
    e3 = tl.load(XW + 2 * r + 6, mask=m, other=0)[:, None]
    o3 = tl.load(XW + 2 * r + 7, mask=m, other=0)[:, None]
    d = tl.load(DX + r // 4, mask=m, other=0.0) * 0.0625  # the dot is 16 sum q q_x
    dot = _dot32(w0, w1, w2, w3, e0, e1, e2, e3, o0, o1, o2, o3, ASM)
    return (dot.to(tl.float32) * d[:, None]) * s[None, :]


@triton.jit
def _gemv_gptq_a8_kernel(
    XW, DX, RS, QW, QZ, S, B, Y, WS, CNT, N, K8, G_SIZE, sz_g, ss_g, k8_per_split,
    SQ_K: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT, BLOCK_N: tl.constexpr,
    BLOCK_K8: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, RBLOCK: tl.constexpr,
    PRE: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    """EVEN: N a multiple of BLOCK_N and every split a whole number of tiles inside K: the loop loads unmasked."""
    tl.static_assert(BLOCK_K8 % 4 == 0, "a tile holds whole blocks of 32 weights")
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k8_start = tl.program_id(1) * k8_per_split
    k8_end = tl.minimum(K8, k8_start + k8_per_split)
    kb = 4 * tl.arange(0, BLOCK_K8 // 4)
    acc2 = tl.zeros([BLOCK_K8 // 4, BLOCK_N], dtype=tl.float32)
    # PRE (0..2) weight tiles loaded before the PDL wait (nothing launched just before writes them), summed after it
    # in the loop's order; a tile wholly past the split's end reads no scale (its group may lie past the last)
    ra = k8_start + kb
    rb = ra + BLOCK_K8
    pa = QW + ra[:, None].to(tl.int64) * SQ_K + n[None, :]
    if PRE >= 1:
        a0, a1, a2, a3 = _block_words(pa, ra, k8_end, n_mask, SQ_K, True, True)
    if PRE >= 2:
        b0, b1, b2, b3 = _block_words(pa + BLOCK_K8 * SQ_K, rb, k8_end, n_mask, SQ_K, True, True)
    wait_prior(PDL)
    if PRE >= 1:
        acc2 += _tile_sum(a0, a1, a2, a3, XW, DX, S, k8_start, ra, k8_end, n, n_mask, G_SIZE, ss_g, ASM)
    if PRE >= 2:
        live = n_mask & (n * 0 + k8_start + BLOCK_K8 < k8_end)
        acc2 += _tile_sum(b0, b1, b2, b3, XW, DX, S, k8_start + BLOCK_K8, rb, k8_end, n, live, G_SIZE, ss_g, ASM)
    p = pa + PRE * BLOCK_K8 * SQ_K
    for k80 in tl.range(k8_start + PRE * BLOCK_K8, k8_end, BLOCK_K8, num_stages=STAGES):
        r = k80 + kb
        w0, w1, w2, w3 = _block_words(p, r, k8_end, n_mask, SQ_K, not EVEN, False)
        acc2 += _tile_sum(w0, w1, w2, w3, XW, DX, S, k80, r, k8_end, n, n_mask, G_SIZE, ss_g, ASM)
        p += BLOCK_K8 * SQ_K
    # the zero points: s z sum x' per group and column, from the blocks' RS = d sum q_x over this split's part of
    # the group (a block of 32 activations is four word rows)
    zshift = (n % 8) * 4
    corr = tl.zeros([BLOCK_N], dtype=tl.float32)
    g32 = G_SIZE // 32
    bb = tl.arange(0, RBLOCK)
    b_start = k8_start // 4
    b_end = tl.cdiv(k8_end, 4)
    for g in range(b_start // g32, tl.cdiv(b_end, g32)):
        lo = tl.maximum(g * g32, b_start)
        hi = tl.minimum(g * g32 + g32, b_end)
        xs = tl.zeros([RBLOCK], dtype=tl.float32)
        for c in range(lo, hi, RBLOCK):
            xs += tl.load(RS + c + bb, mask=c + bb < hi, other=0.0)
        z, s = int4_zero_scale(S, QZ, g, n, n_mask, zshift, ss_g, sz_g)
        corr += z * s * tl.sum(xs, axis=0)
    store_out(Y, B, WS, CNT, n, n_mask, N, tl.sum(acc2, axis=0) - corr, HAS_BIAS, SPLIT, UNROLL)


def accepts(x: torch.Tensor, qw, up=None, options=DEFAULT) -> bool:
    """Whether the W4A8 path takes a call: the run's ``int4_a8`` option on, one row (``up``, SwiGLU's, of x's shape and dtype), a weight
    it has a kernel for (ops/act_int8.py ``takes``: int4 in group order, K and the groups multiples of 32), a float
    activation dtype, inline PTX available (NVIDIA, sm61+ for dp4a) or the CPU interpreter."""
    return options.int4_a8 and takes(qw) and takes_row(x, qw.shape[1], up)


def _plan(table, shape, group_size: int, tiles=None):
    """(block_n, block_k8, num_warps, num_stages) of a launch on an [N, K] int4 weight: block_k8 a power of two of
    at least 4 words (whole blocks of 32), inside one group."""
    n, k = shape
    block_n, block_k, num_warps, num_stages = tiles or table.tile("int4_a8", n, k)
    block_k8 = max(4, 1 << (max(1, block_k // 8).bit_length() - 1))
    if group_size < k:  # a tile must lie inside one group: 8 * block_k8 divides the group size
        while block_k8 > 4 and group_size % (8 * block_k8):
            block_k8 //= 2
    return block_n, block_k8, num_warps, num_stages


def gemv_int4_a8(xq: tuple, qw, dtype: torch.dtype, bias=None, tiles=None, split=None, options=DEFAULT):
    """(xw, dx, rs) of one row (act_int8.py) @ dequantize(qw).T -> [1, N] in ``dtype`` (+ bias)."""
    xw, dx, rs = xq
    n, k = qw.shape
    table = gemv_tiles(xw.device, options)
    block_n, block_k8, num_warps, num_stages = _plan(table, qw.shape, qw.group_size, tiles)
    k8 = k // 8
    grid_n = triton.cdiv(n, block_n)
    per_sm = table.programs_per_sm("int4_a8", n, k)
    split, per = split_plan(grid_n, k8, block_k8, xw.device, split, per_sm)
    y = torch.empty((1, n), dtype=dtype, device=xw.device)
    ws, cnt = split_buffers(split, grid_n, n, xw.device)
    qweight, qzeros, scales = (dense_rows(t) for t in (qw.qweight, qw.qzeros, qw.scales))
    pre = table.prefetch("int4", block_k8 * block_n / (32 * num_warps)) if qweight is qw.qweight else 0
    _gemv_gptq_a8_kernel[(grid_n, split)](
        xw, dx, rs, qweight, qzeros, scales, bias if bias is not None else y, y, ws, cnt, n, k8, qw.group_size,
        qzeros.stride(0), scales.stride(0), per, SQ_K=qweight.stride(0),
        EVEN=n % block_n == 0 and k8 % block_k8 == 0, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, BLOCK_K8=block_k8, STAGES=num_stages, ASM=PTX, RBLOCK=16, PRE=pre,
        UNROLL=int4_tail_unroll(block_n, num_warps, per_sm), num_warps=num_warps, num_stages=num_stages,
        **pdl_options(xw.device, options),
    )  # fmt: skip
    return y
