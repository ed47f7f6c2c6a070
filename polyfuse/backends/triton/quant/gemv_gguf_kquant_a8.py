"""GEMV (one row, or 2..8 rows through a first tile axis) on GGUF Q4_K / Q5_K / Q6_K super-blocks times int8 activations, on integer dot products (``dp4a``).

Reached through gemv_gguf_a8.py (the kernel option ``gguf_a8`` and what it takes), as llama.cpp's CUDA backend
runs these types on q8_1 activations by default: the row is quantized to int8 in blocks of 32
(polyfuse/ops/act_int8.py has the arithmetic; act_int8.py here writes it in natural order), and a K-quant sub-block of
32 weights lines up with one such block. gemv_gguf_kquant.py converts every weight to float and multiplies it with a float
activation (about 1.1 TB/s of packed bytes on the H200, slower than bf16 cuBLAS); here one 32-bit word of quant bytes
holds four consecutive weights in its low nibbles (sub-block 2 j) and four in its high ones (2 j + 1, 32 further on):
two masks, two ``dp4a`` against two activation words. Q5_K ors its fifth bits (bit 2 j and 2 j + 1 of each qh byte,
shifted over the whole word: bit 2 j + t of byte b lands on bit t of byte b) in before the dot. Q6_K (its own kernel
below: 6-bit values minus 32, one int8 scale per 16) builds each word of four 6-bit values from a nibble word and a
2-bit word the same way, and takes 32 sum q_x (one more dp4a, against ones) off the dot.

Per sub-block: (d sc) d_x sum q q_x - (dmin m) d_x sum q_x, the last factor the block's RS (act_int8.py): the
integer sums are exact, the rest float32. Each super-block's header is read as four words and its 16 scales and mins
decoded in registers (gemv_gguf_kquant.py loads six scale bytes per run); split-K with the last program adding the partials (gemv_common.store_out).
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._rounding import PTX
from polyfuse.backends.triton.quant.gemv_common import gemv_tiles, row_chunks, split_buffers, split_plan, store_tile
from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.quant_formats import GGUF_BYTES, GGUF_SUPER


@triton.jit
def _dp4a(w, x, ASM: tl.constexpr):
    """sum_i w_i x_i over the four bytes of int32 words: w's unsigned, x's signed; exact int32."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [w, x], dtype=tl.int32, is_pure=True, pack=1
        )
    else:  # the interpreter
        acc = tl.zeros_like(w)
        for j in tl.static_range(4):
            acc += ((w >> (8 * j)) & 0xFF) * ((x << (24 - 8 * j)) >> 24)
        return acc


@triton.jit
def _scale_min(s0, s1, s2, s):
    """(sc, m) float32 of sub-block(s) ``s`` from the super-block's three scale words (bytes 4 .. 15): s < 4 the low 6
    bits of byte s of s0 (scale) and s1 (min); s >= 4 the nibbles of byte s - 4 of s2 under the top 2 bits of byte
    s - 4 of s0 / s1."""
    t = 8 * (s % 4)
    a = s0 >> t
    b = s1 >> t
    c = s2 >> t
    low = s < 4
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 2) & 0x30))
    m = tl.where(low, b & 63, ((c >> 4) & 15) | ((b >> 2) & 0x30))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def _fp16_half(w, HIGH: tl.constexpr):
    """The float32 value of the low (or HIGH) fp16 half of int32 words."""
    h = (w >> 16) if HIGH else w
    return (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _activation_rows(XW, DX, NB, ROWS, M: tl.constexpr):
    """XW / DX moved to activation row i along a first axis of M (64 NB words, 8 NB blocks a row of NB
    super-blocks), and which of them exist."""
    i = tl.arange(0, M)[:, None, None, None]
    return XW + i.to(tl.int64) * (64 * NB), DX + i.to(tl.int64) * (8 * NB), i < ROWS


@triton.jit
def _gemv_kquant_a8_kernel(
    XW, DX, RS, W32, B, Y, WS, CNT, N, NB, row_words, nb_per_split, ROWS,
    Q5: tl.constexpr, WORDS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, M: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Tiles [M activation rows, BLOCK_N weight rows, 4 BLOCK_B runs, 8 words]: run j of a super-block is its words 8 j .. 8 j + 7, holding
    sub-blocks 2 j (low nibbles) and 2 j + 1 (high); its super-block's header (d and dmin, the 12 scale bytes) is
    four word loads, decoded in registers. Session 19: 3-D tiles, every run its own element of the middle axis (the
    32-weight kernel's shape), took 22-28% off the 4-D [rows, super-blocks, runs, words] version per layer. The
    first axis holds M activation rows (ROWS real): each weight tile is read once for all of them."""
    wait_prior(PDL)
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n3 = n[None, :, None, None]
    b_start = tl.program_id(1) * nb_per_split
    b_end = tl.minimum(NB, b_start + nb_per_split)
    G: tl.constexpr = 4 * BLOCK_B
    g = tl.arange(0, G)[None, None, :, None]
    j = g % 4
    r = tl.arange(0, 8)[None, None, None, :]
    XW, DX, x_ok = _activation_rows(XW, DX, NB, ROWS, M)
    RS += tl.arange(0, M)[:, None, None, None].to(tl.int64) * (8 * NB)
    acc = tl.zeros([M, BLOCK_N, G, 1], dtype=tl.float32)
    for b0 in range(b_start, b_end, BLOCK_B):
        sb = b0 + g // 4  # [1, 1, G, 1]
        g_mask = sb < b_end
        m = (n3 < N) & g_mask
        x_mask = g_mask & x_ok
        wb = n3 * row_words + sb * WORDS  # the super-block's first word
        hd = tl.load(W32 + wb, mask=m, other=0)
        s0 = tl.load(W32 + wb + 1, mask=m, other=0)
        s1 = tl.load(W32 + wb + 2, mask=m, other=0)
        s2 = tl.load(W32 + wb + 3, mask=m, other=0)
        qs = tl.load(W32 + wb + (12 if Q5 else 4) + 8 * j + r, mask=m, other=0)  # run j: words 8 j + r
        lo = qs & 0x0F0F0F0F
        hi = (qs >> 4) & 0x0F0F0F0F
        if Q5:
            qh = tl.load(W32 + wb + 4 + r, mask=m, other=0) >> (2 * j)
            lo |= (qh & 0x01010101) << 4
            hi |= (qh & 0x02020202) << 3
        xw = sb * 64 + 16 * j + r  # activation words of weights 256 sb + 64 j + 4 r ..
        x_lo = tl.load(XW + xw, mask=x_mask, other=0)
        x_hi = tl.load(XW + xw + 8, mask=x_mask, other=0)
        dot_lo = tl.sum(_dp4a(lo, x_lo, ASM), axis=3, keep_dims=True).to(tl.float32)
        dot_hi = tl.sum(_dp4a(hi, x_hi, ASM), axis=3, keep_dims=True).to(tl.float32)
        blk = sb * 8 + 2 * j  # activation block of sub-block 2 j
        dx_lo = tl.load(DX + blk, mask=x_mask, other=0.0)
        dx_hi = tl.load(DX + blk + 1, mask=x_mask, other=0.0)
        rs_lo = tl.load(RS + blk, mask=x_mask, other=0.0)
        rs_hi = tl.load(RS + blk + 1, mask=x_mask, other=0.0)
        sc_lo, m_lo = _scale_min(s0, s1, s2, 2 * j)
        sc_hi, m_hi = _scale_min(s0, s1, s2, 2 * j + 1)
        d = _fp16_half(hd, False)
        dmin = _fp16_half(hd, True)
        acc += d * (sc_lo * (dx_lo * dot_lo) + sc_hi * (dx_hi * dot_hi)) - dmin * (m_lo * rs_lo + m_hi * rs_hi)
    store_tile(Y, B, WS, CNT, n, n_mask, N, acc, ROWS, M, HAS_BIAS, SPLIT)


@triton.jit
def _word(W16, at, mask):
    """int32 words from two 16-bit halves at half-word offsets ``at`` and ``at`` + 1 (low half first)."""
    lo = tl.load(W16 + at, mask=mask, other=0).to(tl.int32) & 0xFFFF
    return lo | (tl.load(W16 + at + 1, mask=mask, other=0).to(tl.int32) << 16)


@triton.jit
def _pair_word(W32, pw, j, odd, mask):
    """Word j of a super-block in a pair of two (420 bytes = 105 words from word ``pw``): the first's word j is word
    j; the second starts 210 bytes in, so its word j is the high half of word 52 + j and the low half of 53 + j."""
    a = tl.load(W32 + pw + j + tl.where(odd, 52, 0), mask=mask, other=0)
    c = tl.load(W32 + pw + j + 53, mask=mask & odd, other=0)
    return tl.where(odd, ((a >> 16) & 0xFFFF) | (c << 16), a)


@triton.jit
def _gemv_q6k_a8_kernel(
    XW, DX, W8, W16, W32, B, Y, WS, CNT, N, NB, row_halves, nb_per_split, ROWS,
    PAIRED: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    M: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Q6_K: tiles [M activation rows, BLOCK_N weight rows, 16 BLOCK_B groups of 16 weights, 4 words]. Group 2 p + t
    of a step is half t of quarter p; quarter (h, s) of a super-block is weights 128 h + 32 s + l: low (s < 2) or high
    nibbles of ql bytes 64 h + 32 (s % 2) + l, the 2 high bits at bits 2 s of qh byte 32 h + l; one int8 scale per
    16. A super-block is 210 bytes: with an even number per row (PAIRED) the quant words are read as 32-bit words by
    pairs of super-blocks (_pair_word), otherwise as 16-bit halves. sum (q - 32) q_x = sum q q_x - 32 sum q_x, both
    from dp4a (the second against 0x01010101)."""
    wait_prior(PDL)
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n3 = n[None, :, None, None]
    b_start = tl.program_id(1) * nb_per_split
    b_end = tl.minimum(NB, b_start + nb_per_split)
    G: tl.constexpr = 16 * BLOCK_B
    g = tl.arange(0, G)[None, None, :, None]
    w = tl.arange(0, 4)[None, None, None, :]
    p = g // 2  # the quarter within the step
    t = g % 2
    h = (p // 4) % 2
    s = p % 4
    XW, DX, x_ok = _activation_rows(XW, DX, NB, ROWS, M)
    acc = tl.zeros([M, BLOCK_N, G, 1], dtype=tl.float32)
    for b0 in range(b_start, b_end, BLOCK_B):
        sb = b0 + p // 8  # [1, 1, G, 1]
        g_mask = sb < b_end
        m = (n3 < N) & g_mask
        x_mask = g_mask & x_ok
        base = n3 * row_halves + sb * 105  # the super-block's first half-word (210 bytes)
        if PAIRED:  # ql words 16 h + 8 (s % 2) + 4 t + w, qh words 32 + 8 h + 4 t + w
            pw = n3 * (row_halves // 2) + (sb // 2) * 105
            odd = (sb % 2) == 1
            ql = _pair_word(W32, pw, 16 * h + 8 * (s % 2) + 4 * t + w, odd, m)
            qh = _pair_word(W32, pw, 32 + 8 * h + 4 * t + w, odd, m)
        else:
            ql = _word(W16, base + 32 * h + 16 * (s % 2) + 8 * t + 2 * w, m)  # ql bytes 64 h + 32 (s % 2) + 16 t + 4 w
            qh = _word(W16, base + 64 + 16 * h + 8 * t + 2 * w, m)  # qh bytes 128 + 32 h + 16 t + 4 w ..
        q = ((ql >> (4 * (s // 2))) & 0x0F0F0F0F) | (((qh >> (2 * s)) & 0x03030303) << 4)
        xw = tl.load(XW + sb * 64 + 32 * h + 8 * s + 4 * t + w, mask=x_mask, other=0)
        dot = tl.sum(_dp4a(q, xw, ASM), axis=3, keep_dims=True)
        xs = tl.sum(_dp4a(tl.full(xw.shape, 0x01010101, tl.int32), xw, ASM), axis=3, keep_dims=True)
        sc = tl.load(W8 + 2 * base + 192 + 8 * h + 2 * s + t, mask=m, other=0).to(tl.float32)
        d = tl.load(W16 + base + 104, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        dx = tl.load(DX + sb * 8 + 4 * h + s, mask=x_mask, other=0.0)
        acc += (d * sc) * (dx * (dot - 32 * xs).to(tl.float32))
    store_tile(Y, B, WS, CNT, n, n_mask, N, acc, ROWS, M, HAS_BIAS, SPLIT)


def gemv_gguf_kquant_a8(xq: tuple, qw, dtype: torch.dtype, bias=None, tiles=None, split=None, options=DEFAULT):
    """(xw, dx, rs) of one row or of M rows in natural order (act_int8.py) @ dequantize(qw).T -> [M, N] in
    ``dtype`` (+ bias); several rows as gemv_gguf_a8.py launches them."""
    xw, dx, rs = xq
    n, k = qw.shape
    rows = xw.numel() // (k // 4)
    table = gemv_tiles(xw.device, options)
    block_n, block_k, num_warps, num_stages = tiles or table.row_tile(qw.format + "_a8", n, k, rows)
    block_b = max(1, block_k // GGUF_SUPER)
    assert block_b & (block_b - 1) == 0, "block_k / 256 super-blocks per step: a power of 2"
    q6 = qw.format == "gguf_q6_k"
    w = qw.qweight
    if w.stride(-1) != 1 or w.stride(0) % (2 if q6 else 4):
        w = w.contiguous()
    nb = k // GGUF_SUPER
    nbytes = GGUF_BYTES[qw.format]
    assert w.shape[1] == nb * nbytes
    y = torch.empty((rows, n), dtype=dtype, device=xw.device)
    b = bias if bias is not None else y
    if q6:
        paired = nb % 2 == 0 and w.stride(0) % 4 == 0 and w.data_ptr() % 4 == 0  # 32-bit words by pairs
        w32 = w.view(torch.int32) if paired else w.view(torch.int16)
        kernel, weights = _gemv_q6k_a8_kernel, (xw, dx, w.view(torch.int8), w.view(torch.int16), w32)
        stride, consts = w.stride(0) // 2, dict(PAIRED=paired)
    else:
        kernel, weights = _gemv_kquant_a8_kernel, (xw, dx, rs, w.view(torch.int32))
        stride, consts = w.stride(0) // 4, dict(Q5=qw.format == "gguf_q5_k", WORDS=nbytes // 4)
    consts.update(HAS_BIAS=bias is not None, BLOCK_B=block_b, ASM=PTX, num_warps=num_warps, num_stages=num_stages,
                  **pdl_options(xw.device, options))  # fmt: skip
    if rows == 1:
        grid_n = triton.cdiv(n, block_n)
        split, per = split_plan(grid_n, nb, block_b, xw.device, split, table.programs_per_sm(qw.format + "_a8", n, k))
        ws, cnt = split_buffers(split, grid_n, n, xw.device)
        kernel[(grid_n, split)](*weights, b, y, ws, cnt, n, nb, stride, per, 1, SPLIT=split, BLOCK_N=block_n, M=1,
                                **consts)  # fmt: skip
        return y
    acts = [t.view(rows, -1) for t in weights[: 2 if q6 else 3]]
    packed = weights[len(acts) :]
    for c, count, m_pad in row_chunks(rows):
        kernel[(triton.cdiv(n, block_n), 1)](*(t[c:] for t in acts), *packed, b, y[c:], y, y, n, nb, stride, nb,
                                             count, SPLIT=1, BLOCK_N=block_n, M=m_pad, **consts)  # fmt: skip
    return y
