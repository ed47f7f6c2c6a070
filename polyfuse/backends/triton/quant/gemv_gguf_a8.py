"""GGUF weights on int8 activations at one row and, through gemm_q.py, 2..8 rows (the kernel option ``gguf_a8``, on
by default): what it takes, the dispatch, and the kernel of the 32-weight types Q8_0 / Q4_0 / Q4_1 (the K-quants'
kernels are gemv_gguf_kquant_a8.py's).

As llama.cpp's CUDA backend (and vLLM's GGUF kernels, which are llama.cpp's) run every GGUF type on q8_1
activations: the row is quantized to int8 in blocks of 32 in natural order (act_int8.py; ops/act_int8.py has the
arithmetic), and a 32-weight block lines up with one activation block. gemv_gguf.py converts every weight to float
(0.6-0.7 TB/s of packed bytes on the H200, slower than bf16 cuBLAS); here a 32-bit word of quant bytes holds four
consecutive signed weights (Q8_0: one ``dp4a`` against one activation word) or eight nibbles (Q4_0 / Q4_1: weights
4 r .. 4 r + 3 in the low nibbles and 16 + 4 r .. in the high ones, two ``dp4a`` after two masks). Per block: Q8_0
d d_x sum q q_x; Q4_0 d (d_x sum q q_x - 8 RS); Q4_1 d d_x sum q q_x + m RS (RS = d_x sum q_x, the activation
block's dequantized sum): the integer sums exact, the rest float32.

Q4_1's 20-byte blocks are five aligned words (d and m, then the quants). Q4_0's 18 and Q8_0's 34 bytes put every
other block 2 bytes off a word boundary, so blocks are read by pairs (9 / 17 words, rows of an even number of blocks):
the pair's second block's quants are whole words, the first's each the high half of one word and the low half of the
next. Split-K with the last program adding the partials (gemv_common.store_out).
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._rounding import PTX
from polyfuse.backends.triton.quant.act_int8 import takes_row, takes_rows
from polyfuse.backends.triton.quant.gemv_common import gemv_tiles, row_chunks, split_buffers, split_plan, store_tile
from polyfuse.backends.triton.quant.gemv_gguf_kquant_a8 import _dp4a, _fp16_half, gemv_gguf_kquant_a8
from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.act_int8 import takes_gguf
from polyfuse.ops.quant_formats import GGUF_BYTES, K_QUANTS


# format -> (FMT code, quant words per block, PAIRED: blocks read by pairs)
LAYOUT = {"gguf_q8_0": (0, 8, True), "gguf_q4_0": (1, 4, True), "gguf_q4_1": (2, 4, False)}


@triton.jit
def _dp4a_signed(w, x, ASM: tl.constexpr):
    """sum_i w_i x_i over the four signed bytes of int32 words: exact int32."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [w, x], dtype=tl.int32, is_pure=True, pack=1
        )
    else:  # the interpreter
        acc = tl.zeros_like(w)
        for j in tl.static_range(4):
            acc += ((w << (24 - 8 * j)) >> 24) * ((x << (24 - 8 * j)) >> 24)
        return acc


@triton.jit
def _gemv_gguf_a8_kernel(
    XW, DX, RS, W32, B, Y, WS, CNT, N, NB, row_words, nb_per_split, ROWS,
    FMT: tl.constexpr, Q: tl.constexpr, PAIRED: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, M: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Tiles [M activation rows, BLOCK_N weight rows, BLOCK_B blocks, Q quant words]: a program's weight tile
    [1, BLOCK_N, ..] is read once for the M rows (ROWS of them real) of activations [M, 1, ..]."""
    wait_prior(PDL)
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n3 = n[None, :, None, None]
    b_start = tl.program_id(1) * nb_per_split
    b_end = tl.minimum(NB, b_start + nb_per_split)
    bb = tl.arange(0, BLOCK_B)[None, None, :, None]
    r = tl.arange(0, Q)[None, None, None, :]
    xm = tl.arange(0, M)[:, None, None, None]
    x_ok = xm < ROWS
    XW += xm.to(tl.int64) * (8 * NB)  # activation row xm: 8 NB words, NB blocks
    DX += xm.to(tl.int64) * NB
    RS += xm.to(tl.int64) * NB
    acc = tl.zeros([M, BLOCK_N, BLOCK_B, 1], dtype=tl.float32)
    for b0 in range(b_start, b_end, BLOCK_B):
        b = b0 + bb  # [1, 1, BLOCK_B, 1]
        b_mask = b < b_end
        m = (n3 < N) & b_mask
        x_mask = b_mask & x_ok
        if PAIRED:  # pair b // 2 is 2 Q + 1 words: [d0, q0 (2 Q words)] [d1, q1] in half-words
            second = (b % 2) == 1
            first = (b % 2) == 0  # not ~second: triton 3.3's interpreter cannot invert an int1 tensor
            pw = n3 * row_words + (b // 2) * (2 * Q + 1)
            a = tl.load(W32 + pw + r + tl.where(second, Q + 1, 0), mask=m, other=0)
            c = tl.load(W32 + pw + r + 1, mask=m & first, other=0)
            qs = tl.where(second, a, ((a >> 16) & 0xFFFF) | (c << 16))
            hd = tl.load(W32 + pw + tl.where(second, Q, 0), mask=m, other=0)
            hd = tl.where(second, (hd >> 16) & 0xFFFF, hd)
        else:  # Q4_1: 5 words a block, [d | m << 16, quants]
            wb = n3 * row_words + b * (Q + 1)
            qs = tl.load(W32 + wb + 1 + r, mask=m, other=0)
            hd = tl.load(W32 + wb, mask=m, other=0)
        d = _fp16_half(hd, False)
        dx = tl.load(DX + b, mask=x_mask, other=0.0)
        xw = tl.load(XW + b * 8 + r, mask=x_mask, other=0)
        if FMT == 0:
            dot = tl.sum(_dp4a_signed(qs, xw, ASM), axis=3, keep_dims=True)
            acc += d * (dx * dot.to(tl.float32))
        else:
            x_hi = tl.load(XW + b * 8 + 4 + r, mask=x_mask, other=0)
            dot = tl.sum(_dp4a(qs & 0x0F0F0F0F, xw, ASM) + _dp4a((qs >> 4) & 0x0F0F0F0F, x_hi, ASM), axis=3,
                         keep_dims=True)  # fmt: skip
            rs = tl.load(RS + b, mask=x_mask, other=0.0)
            if FMT == 1:
                acc += d * (dx * dot.to(tl.float32) - 8.0 * rs)
            else:
                acc += d * (dx * dot.to(tl.float32)) + _fp16_half(hd, True) * rs
    store_tile(Y, B, WS, CNT, n, n_mask, N, acc, ROWS, M, HAS_BIAS, SPLIT)


# Rows of a call that the multi-row launches take (each launch up to gemv_common.ROWS_PER_LAUNCH of them, reading the
# weight once): more go to gemm_q.py's other choices (gemm_gguf.py: Q4_0 / Q4_1 up to 64 rows, Q8_0 / Q4_K up to
# 32; else dequantize + cuBLAS, dequant_mm.py). 16 rows in one launch tied dequantize + cuBLAS on an H200.
MAX_ROWS = 8


def accepts_rows(x: torch.Tensor, qw, up=None, options=DEFAULT) -> bool:
    """Whether the GGUF A8 path takes a call of 2..MAX_ROWS rows (batch decode): as ``accepts`` for one row."""
    k = qw.shape[1]
    rows = x.numel() // max(k, 1)
    return options.gguf_a8 and 2 <= rows <= MAX_ROWS and takes_gguf(qw) and takes_rows(x, k, up)


def accepts(x: torch.Tensor, qw, up=None, options=DEFAULT) -> bool:
    """Whether the GGUF A8 path takes a call: the run's ``gguf_a8`` option on, one row (``up``, SwiGLU's, of x's shape and dtype), a GGUF
    type kept as stored (ops/act_int8.py ``takes_gguf``; Q8_0 / Q4_0 with K a multiple of 64), a float activation
    dtype, inline PTX (NVIDIA sm61+: dp4a) or the CPU interpreter."""
    return options.gguf_a8 and takes_gguf(qw) and takes_row(x, qw.shape[1], up)


def gemv_gguf_a8(xq: tuple, qw, dtype: torch.dtype, bias=None, tiles=None, split=None, options=DEFAULT):
    """(xw, dx, rs) of one row ([K / 4], [K / 32]) or of M rows ([M, K / 4], [M, K / 32]) in natural order
    (act_int8.py) @ dequantize(qw).T -> [M, N] in ``dtype`` (+ bias), for every GGUF type ``accepts`` takes (the
    K-quants through gemv_gguf_kquant_a8.py). Several rows: each launch takes up to gemv_common.ROWS_PER_LAUNCH of them against
    the tile's weight rows, K not split."""
    if qw.format in K_QUANTS:
        return gemv_gguf_kquant_a8(xq, qw, dtype, bias, tiles, split, options)
    xw, dx, rs = xq
    n, k = qw.shape
    fmt_code, words, pairs = LAYOUT[qw.format]
    rows = xw.numel() // (k // 4)
    table = gemv_tiles(xw.device, options)
    block_n, block_k, num_warps, num_stages = tiles or table.row_tile(qw.format + "_a8", n, k, rows)
    block_b = max(1, block_k // 32)
    assert block_b & (block_b - 1) == 0, "block_k / 32 blocks per step: a power of 2"
    w = qw.qweight
    if w.stride(-1) != 1 or w.stride(0) % 4 or w.data_ptr() % 4:
        w = w.contiguous()
    nb = k // 32
    assert w.shape[1] == nb * GGUF_BYTES[qw.format] and (not pairs or nb % 2 == 0)
    y = torch.empty((rows, n), dtype=dtype, device=xw.device)
    w32, b = w.view(torch.int32), bias if bias is not None else y
    consts = dict(FMT=fmt_code, Q=words, PAIRED=pairs, HAS_BIAS=bias is not None, BLOCK_B=block_b, ASM=PTX,
                  num_warps=num_warps, num_stages=num_stages, **pdl_options(xw.device, options))  # fmt: skip
    if rows == 1:
        grid_n = triton.cdiv(n, block_n)
        split, per = split_plan(grid_n, nb, block_b, xw.device, split, table.programs_per_sm(qw.format + "_a8", n, k))
        ws, cnt = split_buffers(split, grid_n, n, xw.device)
        _gemv_gguf_a8_kernel[(grid_n, split)](
            xw, dx, rs, w32, b, y, ws, cnt, n, nb, w.stride(0) // 4, per, 1, SPLIT=split, BLOCK_N=block_n, M=1,
            **consts,
        )  # fmt: skip
        return y
    xw, dx, rs = xw.view(rows, -1), dx.view(rows, -1), rs.view(rows, -1)
    for c, count, m_pad in row_chunks(rows):
        _gemv_gguf_a8_kernel[(triton.cdiv(n, block_n), 1)](
            xw[c:], dx[c:], rs[c:], w32, b, y[c:], y, y, n, nb, w.stride(0) // 4, nb, count, SPLIT=1,
            BLOCK_N=block_n, M=m_pad, **consts,
        )  # fmt: skip
    return y
