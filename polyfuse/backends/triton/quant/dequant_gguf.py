"""GGUF Q8_0 / Q4_0 / Q4_1 blocks dequantized by one kernel into the activations' dtype (prefill and batch decode
through dequant_mm.py: this kernel, then ``F.linear``), instead of the reference's float32 temporaries per call.

Each program takes a tile of rows and blocks: the block's fp16 d (and m) as half-words (every block starts on an
even byte), its quants as bytes: Q8_0's 32 signed bytes are weights 0..31, a Q4_0 / Q4_1 byte j holds weight j in
its low nibble and j + 16 in its high one, so each block is written as one run of 32 (or two of 16) outputs. Values
are the reference's (quant_formats ``dequantize``) bit for bit: d * q, d * (q - 8) and d * q + m are exact products
of an fp16 and a small integer in float32 (one rounding at most, the sum's), then rounded once to the output dtype.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.ops.quant_formats import GGUF_BLOCK, GGUF_BYTES


# rows, blocks of 32 weights, warps
TILE = (16, 8, 4)
# format -> (FMT code, bytes per block, first quant byte)
BYTES = {"gguf_q8_0": (0, 34, 2), "gguf_q4_0": (1, 18, 2), "gguf_q4_1": (2, 20, 4)}


@triton.jit
def _dequant_gguf_kernel(
    W8, W16, WD, N, NB, row_bytes, sd,
    FMT: tl.constexpr, BLOCK_BYTES: tl.constexpr, QS0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    m2 = (n < N)[:, None] & (b < NB)[None, :]
    m3 = m2[:, :, None]
    base = n[:, None] * row_bytes + b[None, :] * BLOCK_BYTES  # the block's first byte (even: d's half-word)
    d = tl.load(W16 + base // 2, mask=m2, other=0).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
    out = WD + n[:, None, None] * sd + b[None, :, None] * 32
    ty = WD.dtype.element_ty
    if FMT == 0:  # 32 signed bytes: weights 0..31
        j = tl.arange(0, 32)
        q = tl.load(W8 + base[:, :, None] + QS0 + j[None, None, :], mask=m3, other=0).to(tl.int32)
        q = ((q & 255) ^ 128) - 128
        tl.store(out + j[None, None, :], cast_rne(q.to(tl.float32) * d, ty), mask=m3)
    else:  # 16 bytes: weight j in byte j's low nibble, weight j + 16 in its high one
        j = tl.arange(0, 16)
        byte = tl.load(W8 + base[:, :, None] + QS0 + j[None, None, :], mask=m3, other=0).to(tl.int32) & 255
        lo = (byte & 15).to(tl.float32)
        hi = (byte >> 4).to(tl.float32)
        if FMT == 1:
            tl.store(out + j[None, None, :], cast_rne((lo - 8.0) * d, ty), mask=m3)
            tl.store(out + 16 + j[None, None, :], cast_rne((hi - 8.0) * d, ty), mask=m3)
        else:
            m = tl.load(W16 + base // 2 + 1, mask=m2, other=0).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
            tl.store(out + j[None, None, :], cast_rne(lo * d + m, ty), mask=m3)
            tl.store(out + 16 + j[None, None, :], cast_rne(hi * d + m, ty), mask=m3)


def dequantize_gguf(qw, dtype: torch.dtype) -> torch.Tensor:
    """dequantize(qw, dtype) of a kept GGUF weight: [N, K]."""
    n, k = qw.shape
    fmt_code, block_bytes, qs0 = BYTES[qw.format]
    w = qw.qweight
    if w.stride(-1) != 1 or w.stride(0) % 2:
        w = w.contiguous()
    nb = k // GGUF_BLOCK
    assert w.shape[1] == nb * GGUF_BYTES[qw.format] == nb * block_bytes
    wd = torch.empty((n, k), dtype=dtype, device=w.device)
    block_n, block_b, num_warps = TILE
    grid = (triton.cdiv(n, block_n), triton.cdiv(nb, block_b))
    _dequant_gguf_kernel[grid](
        w, w.view(torch.int16), wd, n, nb, w.stride(0), wd.stride(0),
        FMT=fmt_code, BLOCK_BYTES=block_bytes, QS0=qs0, BLOCK_N=block_n, BLOCK_B=block_b, num_warps=num_warps,
    )  # fmt: skip
    return wd
