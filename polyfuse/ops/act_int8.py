"""int8 activations in blocks of 32 values: the torch reference of what the W4A8 and the GGUF one-row GEMVs compute.

The kernel option ``int4_a8`` (backends/triton/quant/gemv_int4_a8.py) runs a one-row int4 projection on int8
activations with integer dot products, as llama.cpp's GPU kernels run its 4-bit types on q8_1 activations: the row x
(already in its dtype) is cut into blocks of 32 consecutive values (llama.cpp's q8_1 block); a block's scale is
d = amax / 127 (amax = max |x| over the block, in float32, IEEE divisions) and its values
q = round-half-even(x * (127 / amax)), in -127..127; a block whose amax is below 2^-100 (zeros, subnormals) is all
zeros with d = 0. The product is then dequantize(w) @ (q d), exact in the integers, then float32 multiplies by the
block's and the column's scales and float32 sums. Not weight-only: each activation is moved by at most half a step,
amax / 254 of its block, against about 1/16 of a group's range for every int4 weight.
"""

import torch

from polyfuse.ops.quant_formats import GGUF_BLOCK, GGUF_BYTES


BLOCK = 32
TINY = 2.0**-100  # blocks with amax below this quantize to zeros
PAIRED_BLOCKS = ("gguf_q8_0", "gguf_q4_0")  # 34 / 18 bytes: every other block starts off a 4-byte boundary


def takes(qweight) -> bool:
    """Whether a packed weight has the W4A8 GEMV: int4 in group order, K a multiple of 32, groups of a multiple of 32
    weights (or one group over K)."""
    n, k = qweight.shape
    if qweight.format != "int4" or qweight.act_order or k % BLOCK or qweight.group_size <= 0:
        return False
    return qweight.group_size >= k or qweight.group_size % BLOCK == 0


def takes_gguf(qweight) -> bool:
    """Whether a packed weight has the GGUF int8-activation GEMV: every GGUF type kept as stored (Q8_0, Q4_0, Q4_1,
    Q4_K, Q5_K, Q6_K); Q8_0 / Q4_0, whose blocks the kernel reads by pairs, with an even number of 32-weight blocks
    per row (K a multiple of 64)."""
    if qweight.format not in GGUF_BYTES:
        return False
    return qweight.format not in PAIRED_BLOCKS or (qweight.shape[1] // GGUF_BLOCK) % 2 == 0


def quantize_act_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) -> (q int8 [..., K], d float32 [..., K / 32])."""
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"quantize_act_int8: K={k} is not a multiple of {BLOCK}")
    v = x.float().reshape(*x.shape[:-1], k // BLOCK, BLOCK)
    amax = v.abs().amax(dim=-1)
    live = amax >= TINY
    safe = torch.where(live, amax, torch.ones_like(amax))
    inv = torch.where(live, torch.full_like(amax, 127.0) / safe, torch.zeros_like(amax))  # tensor / tensor: IEEE
    q = torch.round(v * inv[..., None]).clamp(-127, 127)  # torch.round: half to even
    d = torch.where(live, safe / torch.full_like(amax, 127.0), torch.zeros_like(amax))
    return q.to(torch.int8).reshape(x.shape), d


def dequantize_act_int8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 activations q d that the W4A8 GEMV multiplies."""
    k = q.shape[-1]
    return (q.float().reshape(*q.shape[:-1], k // BLOCK, BLOCK) * d[..., None]).reshape(q.shape)
