"""``lora_linear`` with its low-rank adds in one Triton pass: ``y += (h @ w) * mask * scale`` in place.

The op's native form (ops/lora_linear.py) does each add as a GEMM into a new [T, N] tensor in the adapters' dtype
(fp32 for a bf16 model under PEFT's default), a masked scale where there is dropout, and a mixed-dtype add into y:
about 17 bytes moved per element of y. Here one kernel reads y's tile, computes the rank-R product in registers
(R <= 64: the adapters' ranks, summed over a fused projection's parts) in float32, applies the mask and adds, and
writes y once: 5 bytes per element with a mask, 4 without. The forward's output add and the backward's input
gradient per adapter use it (everything else is the native op's). Rounding: the sum in float32, rounded once to y's
dtype, as the native add.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.ops.lora_linear import add_lowrank_native, lora_linear_with


MAX_RANK = 64  # summed ranks beyond this go to the native add (registers)


@triton.jit
def _add_lowrank_kernel(
    Y, H, W, M, T, N, R, stride_y, stride_h, stride_wr, stride_wn, stride_m, scale,
    HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    t_ok, n_ok, r_ok = t < T, n < N, r < R
    h = tl.load(H + t[:, None] * stride_h + r[None, :], mask=t_ok[:, None] & r_ok[None, :], other=0.0)
    w = tl.load(W + r[:, None] * stride_wr + n[None, :] * stride_wn, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    acc = tl.dot(h.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    tile = t_ok[:, None] & n_ok[None, :]
    if HAS_MASK:
        keep = tl.load(M + t[:, None] * stride_m + n[None, :], mask=tile, other=0)
        acc = tl.where(keep != 0, acc * scale, 0.0)
    offs = t[:, None] * stride_y + n[None, :]
    y = tl.load(Y + offs, mask=tile, other=0.0).to(tl.float32) + acc
    tl.store(Y + offs, cast_rne(y, Y.dtype.element_ty), mask=tile)


def add_lowrank(y, h, w, mask=None, scale: float = 1.0) -> None:
    """add_lowrank_native's contract (ops/lora_linear.py) in one kernel; shapes it does not take (a rank above
    MAX_RANK, rows of y or h not unit-strided) go to the native add."""
    t, n = y.shape
    rank = h.shape[1]
    if rank > MAX_RANK or y.stride(1) != 1 or h.stride(1) != 1 or (mask is not None and mask.stride(1) != 1):
        return add_lowrank_native(y, h, w, mask, scale)
    if y.numel() == 0:
        return None
    block_t, block_n = 64, 128
    grid = (triton.cdiv(t, block_t), triton.cdiv(n, block_n))
    m = mask.view(torch.uint8) if mask is not None else y
    _add_lowrank_kernel[grid](
        y, h, w, m, t, n, rank, y.stride(0), h.stride(0), w.stride(0), w.stride(1),
        m.stride(0) if mask is not None else 0, float(scale),
        HAS_MASK=mask is not None, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        num_warps=4,
    )  # fmt: skip
    return None


add_lowrank.takes_column_views = True  # a part's columns of y: rows strided, each row's columns contiguous


def lora_linear(x, weight, bias, adapters):
    return lora_linear_with(add_lowrank, x, weight, bias, adapters)
