"""One-row GEMV reading GGUF Q4_K / Q6_K super-blocks as the file stores them (kept quantized at load).

A row of the weight is K / 256 super-blocks (quant_formats.py has the layouts). Each program owns BLOCK_N rows and
walks its share of the row's super-blocks one at a time, reading the 128 bytes of 4-bit quants in one contiguous load
and reducing their products with the activations per sub-block before the scales apply:

* Q4_K: quant byte t holds weight 64 (t // 32) + t % 32 (low nibble, sub-block 2 (t // 32)) and the weight 32 after
  it (high nibble, the next sub-block). Per super-block: sum over its 8 sub-blocks of d sc_j sum(q x) - dmin m_j
  sum(x), the 6-bit sc_j and m_j decoded from the 12 scale bytes per sub-block (not per weight).
* Q6_K: ql byte u (u = 64 h + c) holds weight 128 h + c (low nibble) and weight 128 h + c + 64 (high); their 2 high
  bits are bits 2 (c // 32) and 2 (c // 32) + 4 of qh byte 32 h + c % 32. Per sub-block of 16: d sc_i sum((q - 32) x).

SWIGLU folds silu(gate) * up into the activation loads; SPLIT > 1 splits the super-blocks over programs whose
partial sums the last one adds (_qgemv.store_out).
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._qgemv import load_x, split_buffers, split_k, store_out, tiles_for
from polyfuse.ops.quant_formats import GGUF_BYTES, GGUF_SUPER


@triton.jit
def q4_k_scale_min(W, base, sb, mask):
    """(sc, m) float32 [BLOCK_N, len(sb)] of Q4_K sub-blocks ``sb`` of the super-blocks at byte ``base`` [BLOCK_N]:
    j < 4: the low 6 bits of scale bytes j and j + 4; j >= 4: the nibbles of byte j + 4 under the top 2 bits of
    bytes j - 4 (scale) and j (min)."""
    low = sb < 4
    i = tl.where(low, sb, sb - 4)
    p = W + base[:, None] + 4
    a = tl.load(p + i[None, :], mask=mask, other=0).to(tl.int32)
    bm = tl.load(p + (i + 4)[None, :], mask=mask, other=0).to(tl.int32)
    c = tl.load(p + (sb + 4)[None, :], mask=mask, other=0).to(tl.int32)
    sc = tl.where(low[None, :], a & 63, (c & 15) | ((a >> 6) << 4))
    m = tl.where(low[None, :], bm & 63, (c >> 4) | ((bm >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def _gemv_kquant_kernel(
    X, U, W, W8, W16, B, Y, WS, CNT, N, NB, row_bytes, nb_per_split,
    SWIGLU: tl.constexpr, Q6: tl.constexpr, BYTES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT,
    BLOCK_N: tl.constexpr,  PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m2 = n_mask[:, None]
    b_start = tl.program_id(1) * nb_per_split
    b_end = tl.minimum(NB, b_start + nb_per_split)
    t = tl.arange(0, 128)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for b in range(b_start, b_end):
        base = n * row_bytes + b * BYTES
        k0 = b * 256
        if Q6:
            ql = tl.load(W + base[:, None] + t[None, :], mask=m2, other=0).to(tl.int32)
            c = t % 64
            kx = k0 + 128 * (t // 64) + c
            qh = tl.load(W + base[:, None] + 128 + (32 * (t // 64) + c % 32)[None, :], mask=m2, other=0).to(tl.int32)
            sh = (2 * (c // 32))[None, :]
            q_lo = ((ql & 15) | (((qh >> sh) & 3) << 4)) - 32
            q_hi = ((ql >> 4) | (((qh >> (sh + 4)) & 3) << 4)) - 32
            x_lo = load_x(X, U, kx, kx >= 0, SWIGLU)
            x_hi = load_x(X, U, kx + 64, kx >= 0, SWIGLU)
            dot_lo = tl.sum(tl.reshape(q_lo.to(tl.float32) * x_lo[None, :], [BLOCK_N, 8, 16]), axis=2)
            dot_hi = tl.sum(tl.reshape(q_hi.to(tl.float32) * x_hi[None, :], [BLOCK_N, 8, 16]), axis=2)
            g = tl.arange(0, 8)
            si = 8 * (g // 4) + g % 4  # the scale of 16 weights starting at 128 h + 16 (g % 4)
            sc_lo = tl.load(W8 + base[:, None] + 192 + si[None, :], mask=m2, other=0).to(tl.float32)
            sc_hi = tl.load(W8 + base[:, None] + 196 + si[None, :], mask=m2, other=0).to(tl.float32)
            d = tl.load(W16 + (base + 208) // 2, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            acc += d * tl.sum(sc_lo * dot_lo + sc_hi * dot_hi, axis=1)
        else:
            qs = tl.load(W + base[:, None] + 16 + t[None, :], mask=m2, other=0).to(tl.int32)
            kx = k0 + 64 * (t // 32) + t % 32
            x_lo = load_x(X, U, kx, kx >= 0, SWIGLU)
            x_hi = load_x(X, U, kx + 32, kx >= 0, SWIGLU)
            dot_lo = tl.sum(tl.reshape((qs & 15).to(tl.float32) * x_lo[None, :], [BLOCK_N, 4, 32]), axis=2)
            dot_hi = tl.sum(tl.reshape((qs >> 4).to(tl.float32) * x_hi[None, :], [BLOCK_N, 4, 32]), axis=2)
            xs_lo = tl.sum(tl.reshape(x_lo, [4, 32]), axis=1)
            xs_hi = tl.sum(tl.reshape(x_hi, [4, 32]), axis=1)
            j = tl.arange(0, 4)
            sc_lo, m_lo = q4_k_scale_min(W, base, 2 * j, m2)
            sc_hi, m_hi = q4_k_scale_min(W, base, 2 * j + 1, m2)
            d = tl.load(W16 + base // 2, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = tl.load(W16 + base // 2 + 1, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            acc += d * tl.sum(sc_lo * dot_lo + sc_hi * dot_hi, axis=1)
            acc -= dmin * tl.sum(m_lo * xs_lo[None, :] + m_hi * xs_hi[None, :], axis=1)
    store_out(Y, B, WS, CNT, n, n_mask, N, acc, HAS_BIAS, SPLIT)


def gemv_kquant(x, up, qw, bias=None, tiles=None, split=None):
    """x [1, K] (the gate with ``up`` for SwiGLU) @ dequantize(qw).T -> [1, N] in x's dtype (+ bias)."""
    n, k = qw.shape
    block_n, _, num_warps, num_stages = tiles or tiles_for(qw.format, n, k)
    w = qw.qweight
    if w.stride(-1) != 1 or w.stride(0) % 2:
        w = w.contiguous()
    nb = k // GGUF_SUPER
    nbytes = GGUF_BYTES[qw.format]
    assert w.shape[1] == nb * nbytes
    grid_n = triton.cdiv(n, block_n)
    split = split or split_k(grid_n, nb, x.device)
    per = triton.cdiv(nb, split)
    split = triton.cdiv(nb, per)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    ws, cnt = split_buffers(split, grid_n, n, x.device)
    _gemv_kquant_kernel[(grid_n, split)](
        x, up if up is not None else x, w, w.view(torch.int8), w.view(torch.int16), bias if bias is not None else y,
        y, ws, cnt, n, nb, w.stride(0), per,
        SWIGLU=up is not None, Q6=qw.format == "gguf_q6_k", BYTES=nbytes, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return y
