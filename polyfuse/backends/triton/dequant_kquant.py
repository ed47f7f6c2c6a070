"""GGUF Q4_K / Q6_K super-blocks dequantized by one kernel into the activations' dtype (prefill and batch decode
through dequant_mm.py: this kernel, then ``F.linear``).

Each program takes BLOCK_N rows of one super-block (256 weights): the 128 quant bytes in one load, the scales per
sub-block (Q4_K's 6-bit pairs decoded as in gemv_kquant.py, Q6_K's int8s), then each weight as the reference
(quant_formats ``dequantize``) computes it: (d * sc) * q, minus dmin * m for Q4_K, in float32, rounded once to the
output dtype. The products are exact in float32 (an fp16 times 6 / 8 bit integers, then times a 4 / 6 bit one) except
Q6_K's last, which rounds once in both, so the values are the reference's bit for bit.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.backends.triton.gemv_kquant import q4_k_scale_min
from polyfuse.ops.quant_formats import GGUF_BYTES, GGUF_SUPER


BLOCK_N, NUM_WARPS = 16, 4


@triton.jit
def _dequant_kquant_kernel(
    W, W8, W16, WD, N, row_bytes, sd, Q6: tl.constexpr, BYTES: tl.constexpr, BLOCK_N: tl.constexpr
):
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1)
    n_mask = n < N
    m2 = n_mask[:, None]
    base = n * row_bytes + b * BYTES
    t = tl.arange(0, 128)
    out = WD + n[:, None] * sd + b * 256
    ty = WD.dtype.element_ty
    if Q6:
        ql = tl.load(W + base[:, None] + t[None, :], mask=m2, other=0).to(tl.int32)
        c = t % 64
        qh = tl.load(W + base[:, None] + 128 + (32 * (t // 64) + c % 32)[None, :], mask=m2, other=0).to(tl.int32)
        sh = (2 * (c // 32))[None, :]
        q_lo = tl.reshape((((ql & 15) | (((qh >> sh) & 3) << 4)) - 32).to(tl.float32), [BLOCK_N, 8, 16])
        q_hi = tl.reshape((((ql >> 4) | (((qh >> (sh + 4)) & 3) << 4)) - 32).to(tl.float32), [BLOCK_N, 8, 16])
        g = tl.arange(0, 8)
        si = 8 * (g // 4) + g % 4
        d = tl.load(W16 + (base + 208) // 2, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        s_lo = d[:, None] * tl.load(W8 + base[:, None] + 192 + si[None, :], mask=m2, other=0).to(tl.float32)
        s_hi = d[:, None] * tl.load(W8 + base[:, None] + 196 + si[None, :], mask=m2, other=0).to(tl.float32)
        idx = tl.reshape(128 * (t // 64) + c, [8, 16])  # ql byte u's low weight; its high one is 64 further
        tl.store(out[:, :, None] + idx[None, :, :], cast_rne(s_lo[:, :, None] * q_lo, ty), mask=m2[:, :, None])
        tl.store(out[:, :, None] + 64 + idx[None, :, :], cast_rne(s_hi[:, :, None] * q_hi, ty), mask=m2[:, :, None])
    else:
        qs = tl.load(W + base[:, None] + 16 + t[None, :], mask=m2, other=0).to(tl.int32)
        q_lo = tl.reshape((qs & 15).to(tl.float32), [BLOCK_N, 4, 32])
        q_hi = tl.reshape((qs >> 4).to(tl.float32), [BLOCK_N, 4, 32])
        j = tl.arange(0, 4)
        sc_lo, m_lo = q4_k_scale_min(W, base, 2 * j, m2)
        sc_hi, m_hi = q4_k_scale_min(W, base, 2 * j + 1, m2)
        d = tl.load(W16 + base // 2, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
        dmin = tl.load(W16 + base // 2 + 1, mask=n_mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
        idx = tl.reshape(64 * (t // 32) + t % 32, [4, 32])  # qs byte t's low weight; its high one is 32 further
        lo = (d * sc_lo)[:, :, None] * q_lo - (dmin * m_lo)[:, :, None]
        hi = (d * sc_hi)[:, :, None] * q_hi - (dmin * m_hi)[:, :, None]
        tl.store(out[:, :, None] + idx[None, :, :], cast_rne(lo, ty), mask=m2[:, :, None])
        tl.store(out[:, :, None] + 32 + idx[None, :, :], cast_rne(hi, ty), mask=m2[:, :, None])


def dequantize_kquant(qw, dtype: torch.dtype) -> torch.Tensor:
    """dequantize(qw, dtype) of a kept Q4_K / Q6_K weight: [N, K]."""
    n, k = qw.shape
    w = qw.qweight
    if w.stride(-1) != 1 or w.stride(0) % 2:
        w = w.contiguous()
    nb = k // GGUF_SUPER
    nbytes = GGUF_BYTES[qw.format]
    assert w.shape[1] == nb * nbytes
    wd = torch.empty((n, k), dtype=dtype, device=w.device)
    _dequant_kquant_kernel[(triton.cdiv(n, BLOCK_N), nb)](
        w, w.view(torch.int8), w.view(torch.int16), wd, n, w.stride(0), wd.stride(0),
        Q6=qw.format == "gguf_q6_k", BYTES=nbytes, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
    )  # fmt: skip
    return wd
