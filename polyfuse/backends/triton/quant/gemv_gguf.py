"""One-row GEMV reading GGUF Q8_0 / Q4_0 / Q4_1 blocks as the file stores them (kept quantized at load).

A row of the weight is K / 32 blocks of BLOCK_HW half-words (Q8_0: 17 = fp16 d + 32 int8; Q4_0: 9 = d + 16 bytes of
nibbles; Q4_1: 10 = d, m + nibbles); the kernel reads the row as int16 half-words, so every block field is aligned.
Half-word h of the quants holds, for Q8_0, weights 2h and 2h + 1 (one signed byte each); for Q4_0 / Q4_1, byte j
holds weight j (low nibble) and j + 16 (high), so the half-word's four nibbles are weights 2h, 2h + 16, 2h + 1,
2h + 17. Per block: Q8_0 d * sum(q x); Q4_0 d * (sum(q x) - 8 sum(x)); Q4_1 d * sum(q x) + m * sum(x).
Each program owns BLOCK_N rows and walks K in BLOCK_B blocks; SWIGLU folds silu(gate) * up into the activation
loads; SPLIT > 1 splits the blocks over programs whose partial sums the last one adds (gemv_common.store_out).
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton.quant.gemv_common import gemv_tiles, load_x, split_buffers, split_plan, store_out
from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.quant_formats import GGUF_BYTES


# format -> (FMT code, half-words per block, first quant half-word, quant half-words)
LAYOUT = {"gguf_q8_0": (0, 17, 1, 16), "gguf_q4_0": (1, 9, 1, 8), "gguf_q4_1": (2, 10, 2, 8)}


@triton.jit
def _gemv_gguf_kernel(
    X, U, W, B, Y, WS, CNT, N, NB, row_hw, nb_per_split,
    SWIGLU: tl.constexpr, FMT: tl.constexpr, BLOCK_HW: tl.constexpr, QS0: tl.constexpr, NQ: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    b_start = tl.program_id(1) * nb_per_split
    b_end = tl.minimum(NB, b_start + nb_per_split)
    bb = tl.arange(0, BLOCK_B)
    h = tl.arange(0, NQ)
    acc = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    for b0 in range(b_start, b_end, BLOCK_B):
        b = b0 + bb
        b_mask = b < b_end
        m2 = n_mask[:, None] & b_mask[None, :]
        base = n[:, None] * row_hw + b[None, :] * BLOCK_HW
        d = tl.load(W + base, mask=m2, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        words = tl.load(W + base[:, :, None] + QS0 + h[None, None, :], mask=m2[:, :, None], other=0)
        words = words.to(tl.int32) & 0xFFFF
        kb = b[:, None] * 32 + 2 * h[None, :]  # [BLOCK_B, NQ]: the first weight of each half-word
        xm = b_mask[:, None]
        if FMT == 0:
            lo = ((words & 255) ^ 128) - 128
            hi = (((words >> 8) & 255) ^ 128) - 128
            x0 = load_x(X, U, kb, xm, SWIGLU)
            x1 = load_x(X, U, kb + 1, xm, SWIGLU)
            dot = tl.sum(lo.to(tl.float32) * x0[None, :, :] + hi.to(tl.float32) * x1[None, :, :], axis=2)
            acc += d * dot
        else:
            x0 = load_x(X, U, kb, xm, SWIGLU)
            x1 = load_x(X, U, kb + 16, xm, SWIGLU)
            x2 = load_x(X, U, kb + 1, xm, SWIGLU)
            x3 = load_x(X, U, kb + 17, xm, SWIGLU)
            q = (words & 15).to(tl.float32) * x0[None, :, :] + ((words >> 4) & 15).to(tl.float32) * x1[None, :, :]
            q += ((words >> 8) & 15).to(tl.float32) * x2[None, :, :] + ((words >> 12) & 15).to(tl.float32) * x3[
                None, :, :
            ]
            dot = tl.sum(q, axis=2)
            xsum = tl.sum(x0 + x1 + x2 + x3, axis=1)
            if FMT == 1:
                acc += d * (dot - 8.0 * xsum[None, :])
            else:
                m = tl.load(W + base + 1, mask=m2, other=0).to(tl.float16, bitcast=True).to(tl.float32)
                acc += d * dot + m * xsum[None, :]
    store_out(Y, B, WS, CNT, n, n_mask, N, tl.sum(acc, axis=1), HAS_BIAS, SPLIT)


def gemv_gguf(x, up, qw, bias=None, tiles=None, split=None, options=DEFAULT):
    """x [1, K] (the gate with ``up`` for SwiGLU) @ dequantize(qw).T -> [1, N] in x's dtype (+ bias)."""
    n, k = qw.shape
    fmt_code, block_hw, qs0, nq = LAYOUT[qw.format]
    block_n, block_k, num_warps, num_stages = tiles or gemv_tiles(x.device, options).formats[qw.format]
    block_b = max(1, block_k // 32)
    w = qw.qweight
    if w.stride(-1) != 1 or (w.stride(0) * w.element_size()) % 2:
        w = w.contiguous()
    w16 = w.view(torch.int16)  # [N, K / 32 * bytes / 2]; every block's fields fall on half-words
    nb = k // 32
    assert w.shape[1] == nb * GGUF_BYTES[qw.format]
    grid_n = triton.cdiv(n, block_n)
    split, per = split_plan(grid_n, nb, block_b, x.device, split)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    ws, cnt = split_buffers(split, grid_n, n, x.device)
    _gemv_gguf_kernel[(grid_n, split)](
        x, up if up is not None else x, w16, bias if bias is not None else y, y, ws, cnt, n, nb, w16.stride(0), per,
        SWIGLU=up is not None, FMT=fmt_code, BLOCK_HW=block_hw, QS0=qs0, NQ=nq, HAS_BIAS=bias is not None,
        SPLIT=split, BLOCK_N=block_n, BLOCK_B=block_b, num_warps=num_warps, num_stages=num_stages,
        **pdl_options(x.device, options),
    )  # fmt: skip
    return y
