"""One-row GEMV reading GGUF Q4_K / Q5_K / Q6_K super-blocks as the file stores them (kept quantized at load).

A row of the weight is K / 256 super-blocks (quant_formats.py has the layouts). Each program owns BLOCK_N rows and
walks its share of the row's super-blocks BLOCK_B at a time (block_k / 256 of the tile), loading the quant bytes as
runs of consecutive bytes, summing q x over each run and applying the run's scales to that sum:

* Q4_K: quant byte 32 j + l holds weight 64 j + l (low nibble, sub-block 2 j) and the weight 32 after it (high
  nibble, sub-block 2 j + 1); w = (d sc) q - dmin m: the run adds d sc sum(q x) - dmin m sum(x), with the 6-bit sc
  and m decoded per run, not per weight.
* Q5_K: Q4_K's runs and scales, the nibbles 32 bytes further on; the fifth bit of weight 64 j + l (and of the one 32
  after it) is bit 2 j (2 j + 1) of qh byte l.
* Q6_K: ql byte 64 h + c holds weight 128 h + c (low nibble) and weight 128 h + c + 64 (high); their 2 high bits are
  bits 2 (c // 32) and 2 (c // 32) + 4 of qh byte 32 h + c % 32; a run of 16 shares one int8 scale.

SWIGLU folds silu(gate) * up into the activation loads; SPLIT > 1 splits the super-blocks over programs whose
partial sums the last one adds (gemv_common.store_out).
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton.quant.gemv_common import gemv_tiles, load_x, split_buffers, split_plan, store_out
from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.quant_formats import GGUF_BYTES, GGUF_SUPER


@triton.jit
def q4_k_scale_min(W, base, sb, mask):
    """(sc, m) float32 of Q4_K sub-block(s) ``sb`` of the super-blocks starting at byte ``base`` (same shape): j < 4:
    the low 6 bits of scale bytes j and j + 4; j >= 4: the nibbles of byte j + 4 under the top 2 bits of bytes j - 4
    (scale) and j (min)."""
    low = sb < 4
    i = tl.where(low, sb, sb - 4)
    p = W + base + 4
    a = tl.load(p + i, mask=mask, other=0).to(tl.int32)
    bm = tl.load(p + i + 4, mask=mask, other=0).to(tl.int32)
    c = tl.load(p + sb + 4, mask=mask, other=0).to(tl.int32)
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    m = tl.where(low, bm & 63, (c >> 4) | ((bm >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def q45_k_quants(W, base, j, r, mask, Q5: tl.constexpr):
    """(q_lo, q_hi) int32 of Q4_K / Q5_K quant byte 32 j + r of the super-blocks at byte ``base``: the weights
    64 j + r (low nibble) and 32 further (high), with Q5_K's fifth bits from qh byte r (bits 2 j and 2 j + 1)."""
    qs = tl.load(W + base + (48 if Q5 else 16) + 32 * j + r, mask=mask, other=0).to(tl.int32)
    q_lo = qs & 15
    q_hi = qs >> 4
    if Q5:
        qh = tl.load(W + base + 16 + r, mask=mask, other=0).to(tl.int32) >> (2 * j)
        q_lo |= (qh & 1) << 4
        q_hi |= (qh & 2) << 3
    return q_lo, q_hi


@triton.jit
def q6_k_quants(W, base, h, c, mask):
    """(q_lo, q_hi) float32, minus 32, of Q6_K's ql bytes 64 h + c of the super-blocks at byte ``base`` (the weights
    128 h + c and 64 further), their 2 high bits from qh byte 32 h + c % 32 (bits 2 (c // 32) and 4 above them)."""
    ql = tl.load(W + base + 64 * h + c, mask=mask, other=0).to(tl.int32)
    qh = tl.load(W + base + 128 + 32 * h + c % 32, mask=mask, other=0).to(tl.int32) >> (2 * (c // 32))
    q_lo = (((ql & 15) | ((qh & 3) << 4)) - 32).to(tl.float32)
    q_hi = (((ql >> 4) | (((qh >> 4) & 3) << 4)) - 32).to(tl.float32)
    return q_lo, q_hi


@triton.jit
def _gemv_kquant_kernel(
    X, U, W, W8, W16, B, Y, WS, CNT, N, NB, row_bytes, nb_per_split,
    SWIGLU: tl.constexpr, Q5: tl.constexpr, Q6: tl.constexpr, BYTES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Tiles [BLOCK_N rows, G runs, L bytes]: Q4_K (and Q5_K) G = 4 BLOCK_B (a super-block's 4 runs of 32 quant bytes, each
    byte two weights 32 apart, of sub-blocks 2 j and 2 j + 1), L = 32; Q6_K G = 8 BLOCK_B (a super-block's 2 halves x
    4 runs of 16 ql bytes, each byte two weights 64 apart with one scale per run), L = 16. Each run's sums of q x
    (and, for Q4_K's mins, of x) are scaled once per run; every tensor is built 3-D, so the scales and activations
    keep the quants' register layout (the first version, with 2-D scales and a reshape, converted them every step)."""
    wait_prior(PDL)
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n3 = n[:, None, None]
    n3_mask = n3 < N
    b_start = tl.program_id(1) * nb_per_split
    b_end = tl.minimum(NB, b_start + nb_per_split)
    if Q6:
        G: tl.constexpr = 8 * BLOCK_B
        L: tl.constexpr = 16
    else:
        G: tl.constexpr = 4 * BLOCK_B
        L: tl.constexpr = 32
    # Every tensor is built [rows, groups, bytes] (size 1 where it does not vary): scales and activations keep the
    # quants' register layout.
    gg = tl.arange(0, G)[None, :, None]
    r = tl.arange(0, L)[None, None, :]
    acc = tl.zeros([BLOCK_N, G, 1], dtype=tl.float32)
    for b0 in range(b_start, b_end, BLOCK_B):
        sb = b0 + gg // (G // BLOCK_B)  # [1, G, 1]: each group's super-block
        g_mask = sb < b_end
        m = n3_mask & g_mask  # [BLOCK_N, G, 1]
        base = n3 * row_bytes + sb * BYTES
        if Q6:
            h = (gg // 4) % 2
            c = 16 * (gg % 4) + r  # [1, G, L]: ql byte 64 h + c; weights 128 h + c and 64 further
            q_lo, q_hi = q6_k_quants(W, base, h, c, m)
            kx = sb * 256 + 128 * h + c
            x_lo = load_x(X, U, kx, g_mask, SWIGLU)
            x_hi = load_x(X, U, kx + 64, g_mask, SWIGLU)
            d = tl.load(W16 + (base + 208) // 2, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            s_lo = d * tl.load(W8 + base + 192 + 8 * h + gg % 4, mask=m, other=0).to(tl.float32)
            s_hi = d * tl.load(W8 + base + 196 + 8 * h + gg % 4, mask=m, other=0).to(tl.float32)
            dot_lo = tl.sum(q_lo * x_lo, axis=2, keep_dims=True)
            dot_hi = tl.sum(q_hi * x_hi, axis=2, keep_dims=True)
            acc += s_lo * dot_lo + s_hi * dot_hi
        else:
            j = gg % 4
            q_lo, q_hi = q45_k_quants(W, base, j, r, m, Q5)
            kx = sb * 256 + 64 * j + r
            x_lo = load_x(X, U, kx, g_mask, SWIGLU)
            x_hi = load_x(X, U, kx + 32, g_mask, SWIGLU)
            sc_lo, m_lo = q4_k_scale_min(W, base, 2 * j, m)
            sc_hi, m_hi = q4_k_scale_min(W, base, 2 * j + 1, m)
            d = tl.load(W16 + base // 2, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = tl.load(W16 + base // 2 + 1, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            dot_lo = tl.sum(q_lo.to(tl.float32) * x_lo, axis=2, keep_dims=True)
            dot_hi = tl.sum(q_hi.to(tl.float32) * x_hi, axis=2, keep_dims=True)
            xs_lo = tl.sum(x_lo, axis=2, keep_dims=True)
            xs_hi = tl.sum(x_hi, axis=2, keep_dims=True)
            acc += d * (sc_lo * dot_lo + sc_hi * dot_hi) - dmin * (m_lo * xs_lo + m_hi * xs_hi)
    store_out(Y, B, WS, CNT, n, n_mask, N, tl.sum(tl.sum(acc, axis=2), axis=1), HAS_BIAS, SPLIT)


def gemv_gguf_kquant(x, up, qw, bias=None, tiles=None, split=None, options=DEFAULT):
    """x [1, K] (the gate with ``up`` for SwiGLU) @ dequantize(qw).T -> [1, N] in x's dtype (+ bias)."""
    n, k = qw.shape
    block_n, block_k, num_warps, num_stages = tiles or gemv_tiles(x.device, options).tile(qw.format, n, k)
    block_b = max(1, block_k // GGUF_SUPER)
    assert block_b & (block_b - 1) == 0, "block_k / 256 super-blocks per step: a power of 2"
    w = qw.qweight
    if w.stride(-1) != 1 or w.stride(0) % 2:
        w = w.contiguous()
    nb = k // GGUF_SUPER
    nbytes = GGUF_BYTES[qw.format]
    assert w.shape[1] == nb * nbytes
    grid_n = triton.cdiv(n, block_n)
    split, per = split_plan(grid_n, nb, block_b, x.device, split)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    ws, cnt = split_buffers(split, grid_n, n, x.device)
    _gemv_kquant_kernel[(grid_n, split)](
        x, up if up is not None else x, w, w.view(torch.int8), w.view(torch.int16), bias if bias is not None else y,
        y, ws, cnt, n, nb, w.stride(0), per,
        SWIGLU=up is not None, Q5=qw.format == "gguf_q5_k", Q6=qw.format == "gguf_q6_k", BYTES=nbytes, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, BLOCK_B=block_b, num_warps=num_warps, num_stages=num_stages,
        **pdl_options(x.device, options),
    )  # fmt: skip
    return y
