"""Shared pieces of the dequantizing GEMMs (gemm_int4.py: int4, gemm_int8_fp8.py: int8 and fp8) and of the
dequantize kernel (dequant_mm.py): the weight tile dequantized in registers exactly as the reference does it
(float32, then one rounding to the activations' dtype), the activation tile with SwiGLU folded in, the tile product,
the split-K epilogue, the default tiles and the split choice.

Split K (SPLIT > 1) is one launch: every program writes its float32 partial tile to a workspace [SPLIT, M, N]; the
last program of an output tile to finish (an int32 counter per tile, kept per device and reset by that program, as
in decode_attention.py) sums the partials in split order, adds the bias and rounds once. No zero fill, no second
kernel, and the sum does not depend on which program finishes last.
"""

import functools

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton import tuned
from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.backends.triton._util import sm_count
from polyfuse.backends.triton.quant.gemv_common import e4m3_to_f32
from polyfuse.core.kernel_options import DEFAULT


@triton.jit
def int4_tile(QW, QZ, S, GI, k0, k_end, n, n_mask, g_tile, sq_k, sz_g, ss_g,
              GATHER: tl.constexpr, RESHAPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The float32 [BLOCK_K, BLOCK_N] tile w[k, n] = (q - (z + 1)) * s (the group's scale and stored zero) of an
    AutoGPTQ int4 weight, for the weights k0 .. k0 + BLOCK_K (k0 a multiple of 8; those from k_end on are masked)
    and the columns n.

    Unpacking: weight k is nibble k % 8 of word [k // 8, n]. By default every k loads its word (each word is loaded
    8 times; the repeats hit the same cache lines, so DRAM reads it once); RESHAPE loads the BLOCK_K / 8 words once
    and expands them to [BLOCK_K / 8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N] in registers. Groups in order (GATHER off):
    the tile lies in group ``g_tile``, one scale and zero per column; GATHER reads the group of every k from g_idx
    (act-order checkpoints, or group sizes no tile fits in)."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_mask = k < k_end
    if RESHAPE:
        k8 = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        m8 = (k8 < k_end // 8)[:, None] & n_mask[None, :]
        words = tl.load(QW + k8[:, None] * sq_k + n[None, :], mask=m8, other=0)
        shifts = tl.arange(0, 8) * 4
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 15, (BLOCK_K, BLOCK_N))
    else:
        words = tl.load(QW + (k // 8)[:, None] * sq_k + n[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0)
        q = (words >> ((k % 8) * 4)[:, None]) & 15
    # q as a float without the int -> float conversion (a quarter-rate instruction): its bits OR-ed into the mantissa
    # of 2^23 and bit-cast give 2^23 + q; minus (2^23 + z) gives q - z exactly (as gemv_int4.py does).
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True)
    zshift = (n % 8) * 4
    if GATHER:
        g = tl.load(GI + k, mask=k_mask, other=0).to(tl.int64)
        m2 = k_mask[:, None] & n_mask[None, :]
        s = tl.load(S + g[:, None] * ss_g + n[None, :], mask=m2, other=0.0).to(tl.float32)
        zw = tl.load(QZ + g[:, None] * sz_g + (n // 8)[None, :], mask=m2, other=0)
        w = (qf - ((((zw >> zshift[None, :]) & 15) + 1).to(tl.float32) + 8388608.0)) * s
    else:
        s = tl.load(S + g_tile * ss_g + n, mask=n_mask, other=0.0).to(tl.float32)
        z = ((tl.load(QZ + g_tile * sz_g + n // 8, mask=n_mask, other=0) >> zshift) & 15) + 1
        w = (qf - (z.to(tl.float32) + 8388608.0)[None, :]) * s[None, :]
    return w


# byte_tile's KIND per 1-byte format: int8, fp8 by the GPU's conversion, fp8 bits decoded by integer arithmetic.
BYTE_KINDS = {"int8": 0, "fp8": 1, "fp8_bits": 2}


@triton.jit
def byte_tile(W, s, k0, k_end, n, n_mask, sw_n, KIND: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 [BLOCK_K, BLOCK_N] tile w[k, n] = q[n, k] * s[n] of a per-channel 1-byte weight [N, K] (int8 or
    fp8 e4m3, KIND as in BYTE_KINDS; s: the columns' float32 scales, loaded once per program)."""
    k = k0 + tl.arange(0, BLOCK_K)
    mask = (k < k_end)[:, None] & n_mask[None, :]
    if KIND == 0:
        q = tl.load(W + n[None, :] * sw_n + k[:, None], mask=mask, other=0).to(tl.int32)
        # q + 128 (1..255) OR-ed into 2^23's mantissa: 2^23 + 128 + q as a float, without an int -> float conversion
        qf = ((q + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    elif KIND == 1:
        qf = tl.load(W + n[None, :] * sw_n + k[:, None], mask=mask, other=0.0).to(tl.float32)
    else:
        qf = e4m3_to_f32(tl.load(W + n[None, :] * sw_n + k[:, None], mask=mask, other=0))
    return qf * s[None, :]


@triton.jit
def load_a(X, U, rows, r_mask, k0, k_end, sx_m, su_m, SWIGLU: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activation tile [rows, k0 .. k0 + BLOCK_K] in float32; with SWIGLU, silu(gate) * up (gate in X, up in U)
    rounded to the activations' dtype after each op, as the two-kernel path (swiglu, then linear) stores it."""
    k = k0 + tl.arange(0, BLOCK_K)
    mask = r_mask[:, None] & (k < k_end)[None, :]
    x = tl.load(X + rows[:, None] * sx_m + k[None, :], mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:
        u = tl.load(U + rows[:, None] * su_m + k[None, :], mask=mask, other=0.0).to(tl.float32)
        g = cast_rne(x / (1.0 + tl.exp(-x)), X.dtype.element_ty).to(tl.float32)
        x = cast_rne(g * u, X.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def dot_acc(acc, a, w, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ w, the weight tile rounded to the activations' dtype first (as the reference's dequantized weight
    is). UPCAST (float32 activations; the CPU interpreter, which has no bfloat16 product): a float32 product
    ("ieee": no tf32); else a DTYPE x DTYPE tensor-core product accumulated in float32."""
    wd = cast_rne(w, DTYPE)
    if UPCAST:
        return tl.dot(a, wd.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(DTYPE), wd, acc)


@triton.jit
def _write(acc, Y, B, rows, cols, r_mask, n_mask, sy_m, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = r_mask[:, None] & n_mask[None, :]
    tl.store(Y + rows[:, None] * sy_m + cols[None, :], cast_rne(acc, Y.dtype.element_ty), mask=mask)


@triton.jit
def store_tile(acc, Y, B, WS, CNT, rows, cols, r_mask, n_mask, M, N, sy_m,
               HAS_BIAS: tl.constexpr, SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The output tile (grid: n tiles, m tiles, splits): with one split, plus bias, rounded once into Y; with several,
    the partial into the workspace and, in the tile's last program, the partials summed in split order, plus bias,
    rounded once into Y. SPLIT: a constexpr or a launch argument (one compiled kernel for every split count)."""
    if SPLIT == 1:
        _write(acc, Y, B, rows, cols, r_mask, n_mask, sy_m, HAS_BIAS)
    else:
        mask = r_mask[:, None] & n_mask[None, :]
        part = WS + rows[:, None] * N + cols[None, :]
        tl.store(part + tl.program_id(2).to(tl.int64) * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        done = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:  # the tile's last program
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for _ in range(0, SPLIT):
                total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                part += M * N
            _write(total, Y, B, rows, cols, r_mask, n_mask, sy_m, HAS_BIAS)
            tl.atomic_xchg(CNT + tile, 0, sem="relaxed", scope="gpu")


# ---- launch choices -----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _tiles(device_name: str, override: str) -> dict:
    return {fmt: tuple(e["tile"]) for fmt, e in tuned.table("qgemm", device_name, override).items()}


def gemm_tiles(device, options=DEFAULT) -> dict:
    """{format: (block_n, block_k, num_warps, num_stages)} of ``device``'s GPU (configs/qgemm: its own file, else
    the default), with the run's ``tile_configs`` over it; block_m follows the rows (16, 32 or 64: all rows of a
    decode batch in one tile, so each weight byte is read once per call)."""
    return _tiles(tuned.gpu_name(device), options.tile_configs)


def tiles_for(fmt: str, m: int, tiles=None, device="cpu", options=DEFAULT) -> tuple:
    """(block_m, block_n, block_k, num_warps, num_stages) for ``m`` rows: ``tiles`` when given (5 values, or 4 with
    block_m from the rows), else the table's for ``fmt``."""
    if tiles is not None and len(tiles) == 5:
        return tuple(tiles)
    block_m = min(64, max(16, triton.next_power_of_2(max(m, 1))))
    block_n, block_k, num_warps, num_stages = tiles or gemm_tiles(device, options)[fmt]
    if tiles is None and block_m == 64:
        num_warps = max(num_warps, 8)  # a 64 x 64 float32 accumulator plus the dequantized tile: more threads
    return block_m, block_n, block_k, num_warps, num_stages


def split_for(n_tiles: int, k_tiles: int, device: torch.device) -> int:
    """Splits of K so that about two programs per multiprocessor run (one split when the tiles already fill them)."""
    want = triton.cdiv(2 * sm_count(device), max(n_tiles, 1))
    return max(1, min(want, k_tiles))


def launch_plan(m: int, n: int, k: int, device, tiles: tuple, split=None):
    """Grid, K per split and splits for (block_m, block_n, block_k, ...) ``tiles``: (grid, k_per_split, split);
    ``split`` when given (at most one per BLOCK_K step), else the rule above."""
    block_m, block_n, block_k = tiles[:3]
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = split or split_for(grid_m * grid_n, k_tiles, device)
    per = triton.cdiv(k_tiles, min(split, k_tiles)) * block_k
    split = triton.cdiv(k, per)  # no empty split
    return (grid_n, grid_m, split), per, split
