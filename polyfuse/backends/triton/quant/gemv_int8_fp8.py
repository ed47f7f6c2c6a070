"""One-row GEMV on 1-byte weights with scales: int8 and fp8 (e4m3) per channel, fp8 per 1x128 block.

y[n] = sum_k x[k] * w[n, k] * s[n]  (per channel: the scale applied once per row at the end)
y[n] = sum_b s[n, b] * sum_{k in block b} x[k] * w[n, k]  (blocks: GROUP = 128 weights of a row per scale)

Each program owns BLOCK_N rows and reads their [BLOCK_N, K] slice of the weight once, accumulating in float32 and
rounding once. The K loop is software-pipelined (``tl.range(num_stages=STAGES)``: the next tiles' weights and
activations are copied asynchronously while one is multiplied; a plain loop, whose loads feed no tl.dot, is not
pipelined by Triton and kept one tile per warp in flight, which left the H200's memory idle).
fp8 converts through the GPU's conversion (or bit arithmetic where it has none: FP8_BITS); int8 without the int ->
float conversion (a quarter-rate instruction): the byte, offset to unsigned, OR-ed into the mantissa of 2^23 and
bit-cast, minus 2^23 + 128, is the integer exactly. SWIGLU folds silu(gate) * up into the activation load. SPLIT > 1
splits K over programs whose partial sums the last one adds (gemv_common.store_out). Inference only.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._rounding import PTX
from polyfuse.backends.triton.quant.gemv_common import (
    dense_rows,
    e4m3_to_f32,
    gemv_tiles,
    load_x,
    no_fp8_cvt,
    split_buffers,
    split_plan,
    store_out,
    tail_unroll,
    weight_tile,
)
from polyfuse.core.kernel_options import DEFAULT


@triton.jit
def _int8_to_f32(w, ASM: tl.constexpr):
    """int8 -> float32 exactly, without the quarter-rate int -> float conversion: the byte offset to unsigned
    (q + 128), placed in the mantissa of 2^23 and bit-cast, minus 2^23 + 128. ASM: one xor per four weights and one
    byte permute per weight (PTX, on NVIDIA GPUs); else the same in Triton arithmetic (the CPU interpreter, ROCm)."""
    if ASM:
        bits = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 v, m;
            xor.b32 v, $4, 0x80808080;
            mov.b32 m, 0x4B000000;
            prmt.b32 $0, v, m, 0x7650;
            prmt.b32 $1, v, m, 0x7651;
            prmt.b32 $2, v, m, 0x7652;
            prmt.b32 $3, v, m, 0x7653;
            }""",
            constraints="=r,=r,=r,=r,r",
            args=[w],
            dtype=tl.int32,
            is_pure=True,
            pack=4,
        )
    else:
        bits = (w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _to_f32(w, FP8_BITS: tl.constexpr, INT8: tl.constexpr, ASM: tl.constexpr):
    if INT8:
        return _int8_to_f32(w, ASM)
    elif FP8_BITS:
        return e4m3_to_f32(w)
    else:
        return w.to(tl.float32)


@triton.jit
def _bytes(W, n, n_mask, k, k_end, sw_n, EARLY: tl.constexpr):
    """The weights of rows n and columns k (those < k_end); EARLY: loaded before the PDL wait, past L1."""
    return weight_tile(W + n[:, None] * sw_n + k[None, :], n_mask[:, None] & (k < k_end)[None, :], 0.0, EARLY)


@triton.jit
def _tile_acc(w, acc2, acc, X, U, S, n, s_mask, k0, k, k_mask, ss_n, SWIGLU: tl.constexpr, GROUP: tl.constexpr,
              FP8_BITS: tl.constexpr, INT8: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """One [BLOCK_N, BLOCK_K] tile of weights at column k0 into the accumulators: per channel acc2 += w x, per
    block acc += s * sum(w x) (a tile lies inside one block; s_mask: the rows whose block scale is read)."""
    x = load_x(X, U, k, k_mask, SWIGLU)
    wf = _to_f32(w, FP8_BITS, INT8, ASM)
    if GROUP == 0:
        acc2 += wf * x[None, :]
    else:
        s = tl.load(S + n * ss_n + k0 // GROUP, mask=s_mask, other=0.0)
        acc += tl.sum(wf * x[None, :], axis=1) * s
    return acc2, acc


@triton.jit
def _gemv_scaled_kernel(
    X, U, W, S, B, Y, WS, CNT, N, K, sw_n, ss_n, k_per_split,
    SWIGLU: tl.constexpr, GROUP: tl.constexpr, FP8_BITS: tl.constexpr, INT8: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr,
    PDL: tl.constexpr, PRE: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    kk = tl.arange(0, BLOCK_K)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # PRE (0..2) tiles of weights loaded before the PDL wait, as in gemv_int4.py: they stream while the kernel
    # before this one still runs, and are summed after it in the loop's order (a tile wholly past the split's end
    # reads no scale: its block may lie past the row's last)
    ka = k_start + kk
    kb = ka + BLOCK_K
    if PRE >= 1:
        wa = _bytes(W, n, n_mask, ka, k_end, sw_n, True)
    if PRE >= 2:
        wb = _bytes(W, n, n_mask, kb, k_end, sw_n, True)
    wait_prior(PDL)
    if PRE >= 1:
        acc2, acc = _tile_acc(wa, acc2, acc, X, U, S, n, n_mask, k_start, ka, ka < k_end, ss_n, SWIGLU, GROUP,
                              FP8_BITS, INT8, ASM)  # fmt: skip
    if PRE >= 2:
        live = n_mask & (n * 0 + k_start + BLOCK_K < k_end)
        acc2, acc = _tile_acc(wb, acc2, acc, X, U, S, n, live, k_start + BLOCK_K, kb, kb < k_end, ss_n, SWIGLU,
                              GROUP, FP8_BITS, INT8, ASM)  # fmt: skip
    for k0 in tl.range(k_start + PRE * BLOCK_K, k_end, BLOCK_K, num_stages=STAGES):
        k = k0 + kk
        k_mask = k < k_end
        w = _bytes(W, n, n_mask, k, k_end, sw_n, False)
        acc2, acc = _tile_acc(w, acc2, acc, X, U, S, n, n_mask, k0, k, k_mask, ss_n, SWIGLU, GROUP, FP8_BITS, INT8,
                              ASM)  # fmt: skip
    if GROUP == 0:
        acc = tl.sum(acc2, axis=1) * tl.load(S + n, mask=n_mask, other=0.0)
    store_out(Y, B, WS, CNT, n, n_mask, N, acc, HAS_BIAS, SPLIT, UNROLL)


def gemv_int8_fp8(x, up, qw, bias=None, tiles=None, split=None, fp8_bits=None, options=DEFAULT):
    """x [1, K] (the gate with ``up`` for SwiGLU) @ dequantize(qw).T -> [1, N] in x's dtype (+ bias)."""
    n, k = qw.shape
    table = gemv_tiles(x.device, options)
    block_n, block_k, num_warps, num_stages = tiles or table.tile(qw.format, n, k)
    group = 128 if qw.format == "fp8_block" else 0
    if group:
        block_k = min(block_k, group)
    w, scales = dense_rows(qw.qweight), dense_rows(qw.scales)
    fp8 = qw.format != "int8"
    if fp8_bits is None:
        fp8_bits = fp8 and no_fp8_cvt(w.device)
    if fp8_bits:
        w = w.view(torch.uint8)
    grid_n = triton.cdiv(n, block_n)
    split, per = split_plan(grid_n, k, block_k, w.device, split, table.programs_per_sm(qw.format, n, k))
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    ws, cnt = split_buffers(split, grid_n, n, x.device)
    # 4 weights a register; no early loads of a copy made just now (dense_rows, the fp8 bit view aside)
    early = w.data_ptr() == qw.qweight.data_ptr()
    pre = table.prefetch(qw.format, block_n * block_k / (4 * 32 * num_warps)) if early else 0
    _gemv_scaled_kernel[(grid_n, split)](
        x, up if up is not None else x, w, scales, bias if bias is not None else y, y, ws, cnt, n, k, w.stride(0),
        scales.stride(0), per,
        SWIGLU=up is not None, GROUP=group, FP8_BITS=bool(fp8_bits), INT8=qw.format == "int8",
        HAS_BIAS=bias is not None, SPLIT=split, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=num_stages,
        ASM=PTX, PRE=pre, UNROLL=tail_unroll(block_n, num_warps), num_warps=num_warps, num_stages=num_stages,
        **pdl_options(x.device, options),
    )  # fmt: skip
    return y
