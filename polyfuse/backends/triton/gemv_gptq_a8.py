"""One-row GEMV on int4 weights in AutoGPTQ's layout times int8 activations (W4A8), on integer dot products.

Opt-in (``POLYFUSE_INT4_A8=1``, read at import; a module attribute, so benchmarks can switch it): the activations are
quantized to int8 in blocks of 8 (polyfuse/ops/act_int8.py: the arithmetic and what it costs; act_int8.py here: the
kernels that write them, fused into the norm or SwiGLU before the projection), as llama.cpp's GPU kernels do for its
4-bit types. The one-row int4 GEMV with bf16 activations (gemv_gptq.py) spends about four instructions per weight (a
byte permute and an FMA, the activation loads); here a word of 8 weights costs two masks, a shift and two ``dp4a``
(the even nibbles against the bytes of x_0, x_2, x_4, x_6, the odd ones against x_1, .., x_7: exact int32), then one
conversion and two float multiplies for the block's scale d and the column's scale s: about one instruction per
weight.

A group's s (sum q x' - z sum x') with x' = q_x d: the tile's [BLOCK_K8, BLOCK_N] float32 accumulator takes
s d (sum q q_x) per word row; the zero term once per group and column after the loop, from the blocks' d sum q_x (RS).
Tiles lie in one group (8 BLOCK_K8 divides the group size); act-order checkpoints are declined (gemv_gptq.py takes
them). Split-K, the early weight tiles and the PDL wait as in gemv_gptq.py.
"""

import os

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._qgemv import (
    dense_rows,
    int4_tail_unroll,
    prefetch_tiles,
    programs_per_sm,
    split_buffers,
    split_plan,
    store_out,
    tiles_for,
    weight_tile,
)
from polyfuse.backends.triton._rounding import PTX


ENABLED = os.environ.get("POLYFUSE_INT4_A8", "0") == "1"


@triton.jit
def _dot8(words, xe, xo, ASM: tl.constexpr):
    """Per int32 word of 8 nibbles q_i (weight 8 k8 + i in bits 4i .. 4i + 3): sum_i q_i x_i with the int8 x_i in
    xe (x_0, x_2, x_4, x_6, low byte first) and xo (x_1, x_3, x_5, x_7); exact int32. ASM: two dp4a; else the same
    integers in Triton arithmetic (the CPU interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 lo, hi, t;
            and.b32 lo, $1, 0x0F0F0F0F;
            shr.u32 hi, $1, 4;
            and.b32 hi, hi, 0x0F0F0F0F;
            dp4a.u32.s32 t, lo, $2, 0;
            dp4a.u32.s32 $0, hi, $3, t;
            }""",
            constraints="=r,r,r,r",
            args=[words, xe, xo],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        acc = tl.zeros_like(words)
        for j in tl.static_range(4):
            acc += ((words >> (8 * j)) & 15) * ((xe << (24 - 8 * j)) >> 24)
            acc += ((words >> (8 * j + 4)) & 15) * ((xo << (24 - 8 * j)) >> 24)
        return acc


@triton.jit
def _words(QW, k8, k8_end, n, n_mask, sq_k, EARLY: tl.constexpr):
    """The packed words of rows k8 (those < k8_end) and columns n; EARLY: loaded before the PDL wait, past L1."""
    return weight_tile(QW + k8[:, None] * sq_k + n[None, :], (k8 < k8_end)[:, None] & n_mask[None, :], 0, EARLY)


@triton.jit
def _tile_sum(words, XW, DX, S, k80, k8, k_mask, n, s_mask, G_SIZE, ss_g, ASM: tl.constexpr):
    """One [BLOCK_K8, BLOCK_N] tile of words starting at word row k80 (inside one group): s d (sum q q_x) per word
    row and column (s_mask: the columns whose scale is read)."""
    s = tl.load(S + ((k80 * 8) // G_SIZE) * ss_g + n, mask=s_mask, other=0.0).to(tl.float32)
    xe = tl.load(XW + 2 * k8, mask=k_mask, other=0)
    xo = tl.load(XW + 2 * k8 + 1, mask=k_mask, other=0)
    d = tl.load(DX + k8, mask=k_mask, other=0.0)
    dot = _dot8(words, xe[:, None], xo[:, None], ASM)
    return (dot.to(tl.float32) * d[:, None]) * s[None, :]


@triton.jit
def _gemv_gptq_a8_kernel(
    XW, DX, RS, QW, QZ, S, B, Y, WS, CNT, N, K8, G_SIZE, sq_k, sz_g, ss_g, k8_per_split,
    HAS_BIAS: tl.constexpr, SPLIT, BLOCK_N: tl.constexpr, BLOCK_K8: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr, ASM: tl.constexpr, RBLOCK: tl.constexpr, PRE: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k8_start = tl.program_id(1) * k8_per_split
    k8_end = tl.minimum(K8, k8_start + k8_per_split)
    kk8 = tl.arange(0, BLOCK_K8)
    acc2 = tl.zeros([BLOCK_K8, BLOCK_N], dtype=tl.float32)
    # PRE (0..2) weight tiles loaded before the PDL wait (nothing launched just before writes them), summed after it
    # in the loop's order; a tile wholly past the split's end reads no scale (its group may lie past the last)
    k8a = k8_start + kk8
    k8b = k8a + BLOCK_K8
    if PRE >= 1:
        wa = _words(QW, k8a, k8_end, n, n_mask, sq_k, True)
    if PRE >= 2:
        wb = _words(QW, k8b, k8_end, n, n_mask, sq_k, True)
    wait_prior(PDL)
    if PRE >= 1:
        acc2 += _tile_sum(wa, XW, DX, S, k8_start, k8a, k8a < k8_end, n, n_mask, G_SIZE, ss_g, ASM)
    if PRE >= 2:
        live = n_mask & (n * 0 + k8_start + BLOCK_K8 < k8_end)
        acc2 += _tile_sum(wb, XW, DX, S, k8_start + BLOCK_K8, k8b, k8b < k8_end, n, live, G_SIZE, ss_g, ASM)
    for k80 in tl.range(k8_start + PRE * BLOCK_K8, k8_end, BLOCK_K8, num_stages=STAGES):
        k8 = k80 + kk8
        words = _words(QW, k8, k8_end, n, n_mask, sq_k, False)
        acc2 += _tile_sum(words, XW, DX, S, k80, k8, k8 < k8_end, n, n_mask, G_SIZE, ss_g, ASM)
    # the zero points: s z sum x' per group and column, from the blocks' RS = d sum q_x over this split's part of
    # the group (a block of 8 activations is a word row)
    zshift = (n % 8) * 4
    corr = tl.zeros([BLOCK_N], dtype=tl.float32)
    g8 = G_SIZE // 8
    rb = tl.arange(0, RBLOCK)
    for g in range(k8_start // g8, tl.cdiv(k8_end, g8)):
        r_lo = tl.maximum(g * g8, k8_start)
        r_hi = tl.minimum(g * g8 + g8, k8_end)
        xs = tl.zeros([RBLOCK], dtype=tl.float32)
        for c in range(r_lo, r_hi, RBLOCK):
            xs += tl.load(RS + c + rb, mask=c + rb < r_hi, other=0.0)
        s = tl.load(S + g * ss_g + n, mask=n_mask, other=0.0).to(tl.float32)
        zw = tl.load(QZ + g * sz_g + n // 8, mask=n_mask, other=0)
        corr += (((zw >> zshift) & 15) + 1).to(tl.float32) * s * tl.sum(xs, axis=0)
    store_out(Y, B, WS, CNT, n, n_mask, N, tl.sum(acc2, axis=0) - corr, HAS_BIAS, SPLIT, UNROLL)


def accepts(x: torch.Tensor, qw) -> bool:
    """Whether the W4A8 path takes a one-row call: switched on, int4 in group order, K and the group size multiples
    of 8, a float activation dtype, inline PTX available (NVIDIA) or the CPU interpreter."""
    n, k = qw.shape
    if not ENABLED or qw.format != "int4" or qw.act_order or k % 8 or qw.group_size <= 0 or qw.group_size % 8:
        return False
    if torch.version.hip is not None or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) >= (6, 1)  # dp4a: sm61+


def _plan(shape, group_size: int, tiles=None):
    """(block_n, block_k8, num_warps, num_stages) of a launch on an [N, K] int4 weight."""
    n, k = shape
    block_n, block_k, num_warps, num_stages = tiles or tiles_for("int4_a8", n, k)
    block_k8 = 1 << (max(1, block_k // 8).bit_length() - 1)
    if group_size < k:  # a tile must lie inside one group: 8 * block_k8 divides the group size
        while block_k8 > 1 and group_size % (8 * block_k8):
            block_k8 //= 2
    return block_n, block_k8, num_warps, num_stages


def gemv_gptq_a8(xq: tuple, qw, dtype: torch.dtype, bias=None, tiles=None, split=None):
    """(xw, dx, rs) of one row (act_int8.py) @ dequantize(qw).T -> [1, N] in ``dtype`` (+ bias)."""
    xw, dx, rs = xq
    n, k = qw.shape
    block_n, block_k8, num_warps, num_stages = _plan(qw.shape, qw.group_size, tiles)
    k8 = k // 8
    grid_n = triton.cdiv(n, block_n)
    per_sm = programs_per_sm("int4_a8", n, k)
    split, per = split_plan(grid_n, k8, block_k8, xw.device, split, per_sm)
    y = torch.empty((1, n), dtype=dtype, device=xw.device)
    ws, cnt = split_buffers(split, grid_n, n, xw.device)
    qweight, qzeros, scales = (dense_rows(t) for t in (qw.qweight, qw.qzeros, qw.scales))
    pre = prefetch_tiles("int4", block_k8 * block_n / (32 * num_warps)) if qweight is qw.qweight else 0
    _gemv_gptq_a8_kernel[(grid_n, split)](
        xw, dx, rs, qweight, qzeros, scales, bias if bias is not None else y, y, ws, cnt, n, k8, qw.group_size,
        qweight.stride(0), qzeros.stride(0), scales.stride(0), per, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, BLOCK_K8=block_k8, STAGES=num_stages, ASM=PTX, RBLOCK=16, PRE=pre,
        UNROLL=int4_tail_unroll(block_n, num_warps, per_sm), num_warps=num_warps, num_stages=num_stages,
        **pdl_options(xw.device),
    )  # fmt: skip
    return y
