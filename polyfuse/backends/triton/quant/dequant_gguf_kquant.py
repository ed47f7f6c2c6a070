"""GGUF Q4_K / Q5_K / Q6_K super-blocks dequantized by one kernel into the activations' dtype (prefill and batch decode
through dequant_mm.py: this kernel, then ``F.linear``).

Each program takes BLOCK_N rows of BLOCK_B super-blocks (256 weights each): the quant bytes as runs of consecutive
bytes, the scales once per run (Q4_K's 6-bit pairs decoded as in gemv_gguf_kquant.py, Q6_K's int8s), then each weight as the reference
(quant_formats ``dequantize``) computes it: (d * sc) * q, minus dmin * m for Q4_K / Q5_K, in float32, rounded once to the
output dtype. The products are exact in float32 (an fp16 times 6 / 8 bit integers, then times a 4 / 5 / 6 bit one) except
Q6_K's last, which rounds once in both, so the values are the reference's bit for bit.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.backends.triton.quant.gemv_gguf_kquant import q4_k_scale_min, q6_k_quants, q45_k_quants
from polyfuse.ops.quant_formats import GGUF_BYTES, GGUF_SUPER


# rows, super-blocks, warps per program
TILE = (2, 4, 2)


@triton.jit
def _dequant_kquant_kernel(
    W, W8, W16, WD, N, NB, row_bytes, sd,
    Q5: tl.constexpr, Q6: tl.constexpr, BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """Tiles [BLOCK_N rows, G runs, L bytes] as gemv_gguf_kquant.py's: each quant byte gives two weights, stored as runs
    of L consecutive outputs."""
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    if Q6:
        G: tl.constexpr = 8 * BLOCK_B
        L: tl.constexpr = 16
    else:
        G: tl.constexpr = 4 * BLOCK_B
        L: tl.constexpr = 32
    gg = tl.arange(0, G)
    r = tl.arange(0, L)
    sb = tl.program_id(1) * BLOCK_B + gg // (G // BLOCK_B)
    m2 = (n < N)[:, None] & (sb < NB)[None, :]
    m3 = m2[:, :, None]
    base = n[:, None] * row_bytes + sb[None, :] * BYTES
    out = WD + n[:, None, None] * sd + (sb * 256)[None, :, None]
    ty = WD.dtype.element_ty
    if Q6:
        h = (gg // 4) % 2
        g = gg % 4
        c = 16 * g[:, None] + r[None, :]
        q_lo, q_hi = q6_k_quants(W, base[:, :, None], h[None, :, None], c[None, :, :], m3)
        d = tl.load(W16 + (base + 208) // 2, mask=m2, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        s_lo = d * tl.load(W8 + base + 192 + 8 * h[None, :] + g[None, :], mask=m2, other=0).to(tl.float32)
        s_hi = d * tl.load(W8 + base + 196 + 8 * h[None, :] + g[None, :], mask=m2, other=0).to(tl.float32)
        at = out + (128 * h[:, None] + c)[None, :, :]
        tl.store(at, cast_rne(s_lo[:, :, None] * q_lo, ty), mask=m3)
        tl.store(at + 64, cast_rne(s_hi[:, :, None] * q_hi, ty), mask=m3)
    else:
        j = gg % 4
        q_lo, q_hi = q45_k_quants(W, base[:, :, None], j[None, :, None], r[None, None, :], m3, Q5)
        sc_lo, m_lo = q4_k_scale_min(W, base, 2 * j[None, :], m2)
        sc_hi, m_hi = q4_k_scale_min(W, base, 2 * j[None, :] + 1, m2)
        d = tl.load(W16 + base // 2, mask=m2, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = tl.load(W16 + base // 2 + 1, mask=m2, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        lo = (d * sc_lo)[:, :, None] * q_lo.to(tl.float32) - (dmin * m_lo)[:, :, None]
        hi = (d * sc_hi)[:, :, None] * q_hi.to(tl.float32) - (dmin * m_hi)[:, :, None]
        at = out + (64 * j[:, None] + r[None, :])[None, :, :]
        tl.store(at, cast_rne(lo, ty), mask=m3)
        tl.store(at + 32, cast_rne(hi, ty), mask=m3)


def dequantize_kquant(qw, dtype: torch.dtype, tile=None) -> torch.Tensor:
    """dequantize(qw, dtype) of a kept Q4_K / Q5_K / Q6_K weight: [N, K]."""
    n, k = qw.shape
    w = qw.qweight
    if w.stride(-1) != 1 or w.stride(0) % 2:
        w = w.contiguous()
    nb = k // GGUF_SUPER
    nbytes = GGUF_BYTES[qw.format]
    assert w.shape[1] == nb * nbytes
    wd = torch.empty((n, k), dtype=dtype, device=w.device)
    block_n, block_b, num_warps = tile or TILE
    assert block_b & (block_b - 1) == 0, "super-blocks per program: a power of 2"
    _dequant_kquant_kernel[(triton.cdiv(n, block_n), triton.cdiv(nb, block_b))](
        w, w.view(torch.int8), w.view(torch.int16), wd, n, nb, w.stride(0), wd.stride(0),
        Q5=qw.format == "gguf_q5_k", Q6=qw.format == "gguf_q6_k", BYTES=nbytes, BLOCK_N=block_n, BLOCK_B=block_b, num_warps=num_warps,
    )  # fmt: skip
    return wd
