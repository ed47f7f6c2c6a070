"""Shared pieces of the quantized one-row GEMVs (gemv_int8_fp8.py, gemv_int4.py, gemv_gguf.py, gemv_gguf_kquant.py): the
activation load
with SwiGLU folded in, the fp8 bit decoding for GPUs without fp8 conversions, tile choice and split-K launch."""

import json
import os

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.backends.triton._util import sm_count


@triton.jit
def load_x(X, U, offs, mask, SWIGLU: tl.constexpr):
    """x[offs] in float32; with SWIGLU, silu(gate) * up rounded as the two-kernel path stores it (gate in X)."""
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        g = cast_rne(x / (1.0 + tl.exp(-x)), X.dtype.element_ty).to(tl.float32)
        x = cast_rne(g * u, X.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def e4m3_to_f32(bits):
    """float8 e4m3fn bit patterns (uint8) -> float32 by integer arithmetic (GPUs before sm89 have no fp8 cvt)."""
    b = bits.to(tl.uint32)
    sign = (b >> 7) & 1
    e = (b >> 3) & 15
    m = b & 7
    normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # subnormal: m / 8 * 2^-6
    sub = tl.where(sign == 1, -sub, sub)
    return tl.where(e == 0, sub, normal)


@triton.jit
def int4_group_term(S, QZ, g, n, n_mask, zshift, ss_g, sz_g):
    """(16 + z) s per column n of int4 group g (s its scale, z AutoGPTQ's stored zero plus one): both int4 kernels
    sum an offset form of q per tile (gemv_int4.py 2 + q / 8, gemm_int4_mma.py 1 + q / 16), scaled so that the
    group's s (sum q x - z sum x) is that sum minus this term times the group's activation sum."""
    z, s = int4_zero_scale(S, QZ, g, n, n_mask, zshift, ss_g, sz_g)
    return (16.0 + z) * s


@triton.jit
def int4_zero_scale(S, QZ, g, n, n_mask, zshift, ss_g, sz_g):
    """(z, s) per column n of int4 group g in float32: AutoGPTQ's stored zero plus one, and the scale."""
    s = tl.load(S + g * ss_g + n, mask=n_mask, other=0.0).to(tl.float32)
    zw = tl.load(QZ + g * sz_g + n // 8, mask=n_mask, other=0)
    return (((zw >> zshift) & 15) + 1).to(tl.float32), s


@triton.jit
def store_out(Y, B, WS, CNT, n, n_mask, N, y, HAS_BIAS: tl.constexpr, SPLIT, UNROLL: tl.constexpr = 4):
    """One split: the row's result (plus bias) rounded once into Y. Several (grid: column blocks x splits): the
    float32 partial into the workspace WS [SPLIT, N]; the column block's last program (an atomic counter per block,
    left zero again) sums the partials in split order, adds the bias and rounds once into Y: no zero-fill before the
    launch, no conversion after it, and the same sum on every run. The last program's loads are issued UNROLL
    partials at a time (``tail_unroll``), so its tail costs SPLIT / UNROLL L2 round trips, not SPLIT."""
    if SPLIT == 1:
        if HAS_BIAS:
            y += tl.load(B + n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(Y + n, cast_rne(y, Y.dtype.element_ty), mask=n_mask)
    else:
        tl.store(WS + tl.program_id(1).to(tl.int64) * N + n, y, mask=n_mask)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        done = tl.atomic_add(CNT + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:  # the column block's last program
            total = tl.zeros_like(y)
            for s0 in range(0, SPLIT, UNROLL):
                for j in tl.static_range(UNROLL):
                    ok = n_mask & (n * 0 + s0 + j < SPLIT)
                    total += tl.load(WS + (s0 + j) * N + n, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(B + n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(Y + n, cast_rne(total, Y.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(CNT + tl.program_id(0), 0, sem="relaxed", scope="gpu")


@triton.jit
def store_rows(Y, B, n, n_mask, N, y, ROWS, M: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A multi-row GEMV program's results y [M, BLOCK_N] for columns n of rows 0 .. ROWS - 1, plus the bias, rounded
    once into Y [ROWS, N] (unit column stride, row stride N). No split of K."""
    m = tl.arange(0, M).to(tl.int64)[:, None]
    mask = (m < ROWS) & n_mask[None, :]
    if HAS_BIAS:
        y += tl.load(B + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m * N + n[None, :], cast_rne(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def store_tile(Y, B, WS, CNT, n, n_mask, N, acc, ROWS, M: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT):
    """The GGUF A8 GEMVs' accumulator [M, BLOCK_N, blocks, 1] summed and stored: one activation row through
    store_out (split K too), several through store_rows."""
    out = tl.sum(tl.sum(acc, axis=3), axis=2)
    if M == 1:
        store_out(Y, B, WS, CNT, n, n_mask, N, tl.sum(out, axis=0), HAS_BIAS, SPLIT)
    else:
        store_rows(Y, B, n, n_mask, N, out, ROWS, M, HAS_BIAS)


def tail_unroll(block_n: int, num_warps: int, regs: int = 64, most: int = 8) -> int:
    """Partials the split's last program loads at once: as many as ``regs`` registers per thread hold (its columns
    per thread times the partials), at most ``most`` and at least 4 (what LLVM made of the plain loop). The int4
    GEMV passes more (int4_tail_unroll): its 1-warp programs split K 17-66 ways, and each round of loads is an L2
    round trip."""
    per_thread = max(1, block_n // (32 * num_warps))
    return max(4, min(most, regs // per_thread))


def tail_regs(per_sm: int, num_warps: int) -> int:
    """Registers per thread the tail's partials may take: what ``per_sm`` programs of ``num_warps`` warps each get
    of a multiprocessor's 65536, at most 128, so that holding more partials does not cost programs per SM."""
    return min(128, 65536 // (per_sm * 32 * num_warps))


def int4_tail_unroll(block_n: int, num_warps: int, per_sm: int) -> int:
    """The int4 GEMV's tail: as many partials at a time as tail_regs leaves registers for, at most 32 for 1-warp
    programs and 16 for larger ones. One H200, session 13, us per call in a graph of calls, partials loaded 8 at a
    time -> 16 / 32: 8B qkv (4 warps, 22 splits) 10.10 -> 9.52 / 9.60, o (33) 8.21 -> 7.54 / 7.34, gate/up (19) 26.21
    -> 26.07 / 26.05, down (66) 17.46 -> 16.55 / 15.95; 70B qkv (2 warps) 21.4 -> 20.7 / 26.2, o 16.5 -> 16.0 / 15.8,
    down 48.9 -> 48.7 / 48.2; the 8B LM head (16 columns per thread, 32 programs per SM) is slower with more (85.9 at
    8, 90.4 at 32), as is the 70B gate/up (24 per SM: 78.7 at 8, 81.6 at 32): tail_regs keeps those at 4-5."""
    return tail_unroll(block_n, num_warps, tail_regs(per_sm, num_warps), 32 if num_warps == 1 else 16)


def prefetch_tiles(fmt: str, tile_regs: float) -> int:
    """Tiles of weights a one-row GEMV program loads before its PDL wait (no kernel before it writes them, so they
    may stream while that kernel still runs): as many as the format's budget of 32-bit registers per thread
    (PREFETCH_REGS; none for a format it does not name) holds, at most 2; ``tile_regs``: one tile's."""
    if not PREFETCH:
        return 0
    return int(max(0, min(2, PREFETCH_REGS.get(fmt, 0) // max(tile_regs, 1))))


@triton.jit
def weight_tile(ptrs, mask, other, EARLY: tl.constexpr):
    """A GEMV's weight tile; EARLY: loaded before the PDL wait (prefetch_tiles), past L1."""
    if EARLY:
        w = tl.load(ptrs, mask=mask, other=other, cache_modifier=".cg")
    else:
        w = tl.load(ptrs, mask=mask, other=other)
    return w


# Tiles per format: (block_n, block_k, num_warps, num_stages); block_k counts weights along K (int4: a multiple of
# 8; gguf: of 32; the K-quants: a power-of-2 multiple of 256); num_stages is the K loop's software-pipelining depth (tiles in flight). int8 / fp8: the least
# time summed over the Llama-3-8B projections on one H200 (benchmark_linear.py --quant int4,int8,fp8 --gemv_sweep,
# run 22, with the pipelined loop: 65.4 / 66.4 us per layer, against 79.7 / 92.7 in run 21); int4: the least summed
# over the Llama-3-8B and Llama-2-70B projections (run 25: 78.8 / 232.3 us per layer with this tile, 71.5 / 209.6
# with SHAPE_TILES, against 87.3 / 277.7 for run 24's kernel and tiles in the same call); fp8_block and the 32-weight GGUF
# types: not tuned on a GPU yet; Q4_K / Q6_K: swept on the 8B projections in run 32. POLYFUSE_QGEMV_TILES='{"int4": [64, 128, 4, 3], ...}' replaces
# entries.
TILES = {
    "int8": (32, 256, 4, 4),
    "fp8": (32, 256, 4, 4),
    "fp8_block": (16, 128, 4, 3),
    "int4": (512, 64, 4, 3),
    "int4_mma": (256, 128, 4, 3),
    "int4_a8": (256, 64, 2, 2),  # gemv_int4_a8.py (POLYFUSE_INT4_A8=1): the best on every 8B projection (session 17)
    "gguf_q8_0": (8, 256, 4, 3),
    "gguf_q4_0": (8, 256, 4, 3),
    "gguf_q4_1": (8, 256, 4, 3),
    "gguf_q4_k": (4, 512, 1, 3),  # block_k: 256 per super-block a step holds (gemv_gguf_kquant.py; session 16)
    "gguf_q5_k": (1, 1024, 1, 3),  # session 18: 8B per layer 183 -> 133 us against Q4_K's tile
    # gemv_gguf_kquant_a8.py / gemv_gguf_a8.py, swept on the 8B projections (session 19: one row per program, 1-2 warps,
    # 32-64 blocks a step won every projection, Q4_K / Q5_K at 8B and 70B too; a program per row fills the GPU, so K
    # is not split)
    "gguf_q4_k_a8": (1, 2048, 1, 3),
    "gguf_q5_k_a8": (1, 2048, 1, 3),
    # 3-D tiles (session 19): 8B per layer 109.8 -> 105.6 us; read by 32-bit word pairs (session 21): 106.5 -> 99.6
    "gguf_q6_k_a8": (1, 2048, 2, 3),
    "gguf_q8_0_a8": (1, 2048, 1, 3),
    "gguf_q4_0_a8": (1, 2048, 1, 3),
    "gguf_q4_1_a8": (1, 2048, 2, 3),
    "gguf_q6_k": (2, 512, 1, 3),
}
# (format, N, K) -> tile where a sweep found a better one than the format's entry above for that projection (one H200;
# us, format tile -> this tile). int8 / fp8, Llama-3-8B (run 22): qkv 8.96 vs 10.60 int8, 8.72 vs 9.74 fp8; gate/up fp8
# 30.80 at 3 stages vs 32.43 (o and down: the format tile then; run 40 replaced o, gate/up and down). Session 11's
# sweep found 16 x 256 / 16 x 512 tiles 1-3 us faster per call for qkv, o and down, but the graphed decode was not:
# 381.8-382.0 against 383.1-383.6 tok/s (int8), 387.9-388.2 against 389.3-389.5 (fp8), three alternating passes on one
# model: kept as they are. Session 12 again, with smaller programs (1-2 warps, 4-16 columns) and 2-16 per SM: 8B qkv
# 9.58 -> 8.91 us, o 8.54 -> 7.18, down 20.16 -> 16.85, LM head 136.87 -> 120.35 (int8; fp8 alike), yet the decode was
# slower: 383.3 against 388.5 tok/s (int8), 393.4 against 396.4 (fp8), four alternating passes: kept as they are.
# Llama-2-70B (run 24): int8 o 20.14 -> 19.26, gate/up 117.63 -> 111.86, down 58.35 -> 57.20; fp8 o 19.53 -> 18.55,
# gate/up 116.65 -> 111.36, down 57.65 -> 56.66 (qkv: the format tile; run 41 replaced fp8's gate/up and down). int4
# (run 25, the byte-permute kernel; its format tile 512 x 64 is the least summed over both models; the same tile
# measured 4-9% apart between passes of one call). int4 since session 12 (weights loaded before the PDL wait,
# prefetch_tiles): tile and programs per SM swept
# together in three rounds, smaller programs and more of them per SM each time (1-warp programs of 128-512 columns at
# 8-32 per SM won most projections). us per call in a CUDA graph of calls, session 11's entries with the prefetch ->
# these: 8B qkv 12.41 -> 9.53, o 8.08 -> 7.83, gate/up 27.98 -> 25.77, down 23.94 -> 16.94, LM head 95.94 -> 83.38; 70B
# qkv 23.70 -> 20.99, o 19.35 -> 16.48, gate/up 88.45 -> 80.0, down 53.94 -> 47.75. Decode batch 1, the same model,
# alternating, per round: 8B 364.3 -> 385.8 -> 388.1 -> 390.5 tok/s, 70B 63.0 -> 65.8 -> 68.3 -> 68.5.
SHAPE_TILES = {
    ("gguf_q6_k_a8", 28672, 4096): (1, 1024, 2, 3),  # session 21, word pairs: 49.6 -> 48.0 us
    ("gguf_q4_0_a8", 6144, 4096): (1, 2048, 2, 3),  # session 19: 2-3% less than the format's tile
    ("gguf_q4_0_a8", 4096, 4096): (1, 2048, 2, 3),
    ("gguf_q4_0_a8", 4096, 14336): (1, 1024, 1, 3),
    ("gguf_q4_1_a8", 4096, 14336): (1, 2048, 1, 3),
    # Q6_K on float activations (session 18, us against the format tile): 8B qkv 20.4 -> 18.7, o 20.0 -> 12.9, down
    # 67.3 -> 42.2 (gate/up: the format tile)
    ("gguf_q6_k", 6144, 4096): (1, 1024, 1, 3),
    ("gguf_q6_k", 4096, 4096): (2, 1024, 1, 3),
    ("gguf_q6_k", 4096, 14336): (2, 1024, 1, 3),
    ("int8", 6144, 4096): (16, 512, 4, 4),
    ("fp8", 6144, 4096): (16, 512, 4, 4),
    # Llama-3-8B o, gate/up and down in int8 / fp8 (session 25, run 40): chosen by the graphed decode itself (batch 1,
    # head packed), not by per-call times, one projection at a time with the others at their best so far, three
    # rounds of 4-8 candidates each; then against the tiles before, alternating in one process: fp8 391.5 -> 405.8
    # tok/s, int8 385.7 -> 399.0 (docs/benchmarks.md run 40). Fewer rows per program, more programs.
    ("int8", 4096, 4096): (8, 512, 4, 4),
    ("fp8", 4096, 4096): (8, 512, 4, 4),
    ("int8", 28672, 4096): (32, 128, 2, 4),
    ("fp8", 28672, 4096): (32, 128, 2, 4),
    ("int8", 4096, 14336): (8, 1024, 4, 3),
    ("fp8", 4096, 14336): (8, 1024, 4, 3),
    ("int4", 6144, 4096): (256, 128, 4, 2),
    ("int4", 4096, 4096): (128, 64, 1, 2),
    ("int4", 28672, 4096): (256, 32, 1, 2),
    ("int4", 4096, 14336): (128, 64, 1, 2),
    ("int4", 128256, 4096): (512, 16, 1, 2),
    ("int8", 8192, 8192): (16, 512, 4, 3),
    ("int8", 57344, 8192): (16, 512, 4, 4),
    ("int8", 8192, 28672): (16, 512, 4, 3),
    ("fp8", 8192, 8192): (16, 512, 4, 3),
    # Llama-2-70B fp8 gate/up and down (session 26, run 41): chosen by the graphed decode as the 8B ones above (7 and
    # 6 candidates, one round; q/k/v and o kept theirs), int8's tiles: 56.2 -> 57.1 tok/s, alternating in one
    # process (int8's 70B tiles, judged the same way, stay)
    ("fp8", 57344, 8192): (16, 512, 4, 4),
    ("fp8", 8192, 28672): (16, 512, 4, 3),
    ("int4", 10240, 8192): (256, 32, 2, 2),
    ("int4", 8192, 8192): (128, 64, 1, 2),
    ("int4", 57344, 8192): (512, 16, 1, 2),
    ("int4", 8192, 28672): (128, 64, 1, 2),
    # the W4A8 GEMV (gemv_int4_a8.py, POLYFUSE_INT4_A8=1), session 17's sweep with its blocks of 32 (one H200, us
    # per call in a graph of calls, against the bf16-activation int4 GEMV's): 8B qkv 7.60 vs 9.53, o 6.60 vs 7.18,
    # gate/up 18.89 vs 26.19, down 14.03 vs 16.19, LM head 70.07 vs 85.68; Llama-2-70B qkv 15.74 vs 20.78, o 14.75
    # vs 15.77, gate/up 65.79 vs 83.19, down 37.43 vs 47.96 (70B decode 81.5 tok/s with these, 75.0 with the first
    # sweep's 70B tiles).
    ("int4_a8", 6144, 4096): (256, 64, 2, 2),
    ("int4_a8", 4096, 4096): (256, 64, 2, 2),
    ("int4_a8", 28672, 4096): (256, 64, 2, 2),
    ("int4_a8", 4096, 14336): (256, 64, 2, 2),
    ("int4_a8", 128256, 4096): (256, 64, 2, 2),
    ("int4_a8", 10240, 8192): (512, 64, 4, 2),
    ("int4_a8", 8192, 8192): (256, 128, 2, 2),
    ("int4_a8", 57344, 8192): (256, 64, 2, 2),
    ("int4_a8", 8192, 28672): (256, 128, 2, 2),
    # the int4 tensor-core kernel at 16 rows, activations plane-major (session 11's sweep; us, against the format tile
    # 256 x 128 x 4 warps x 3 stages at two programs per SM where it differs): 8B qkv 15.64, o 13.40, down 29.34;
    # 70B qkv 34.82, o 30.66 (gate/up, down and the LM head: the format tile, PROGRAMS_PER_SM below)
    ("int4_mma", 6144, 4096): (128, 128, 4, 3),
    ("int4_mma", 4096, 4096): (128, 128, 4, 3),
    ("int4_mma", 4096, 14336): (128, 128, 4, 3),
    ("int4_mma", 10240, 8192): (128, 128, 4, 5),
    ("int4_mma", 8192, 8192): (128, 128, 4, 5),
}
# (format, N, K) -> programs per multiprocessor that the K split aims at, where more than the default two measured
# faster (one H200, session 11's sweeps of the split): the CUDA-core int4 GEMV at the 4 warps it runs is short of
# warps in flight with two (Nsight Compute: 12% achieved occupancy on the 8B gate/up), so more, shorter splits keep
# more loads in flight: 8B gate/up 30.2 us at 4 (37.9 at 2), LM head 99.3 at 8 (138.8 at 2, 512 x 64), 70B gate/up
# 94.2 at 8 (117.5 at 2, 2048 x 16). int4_mma (gemm_int4_mma.py, 16 rows, plane-major activations, with the tiles
# above): 8B qkv 15.64 us, down 29.34, LM head 124.44; 70B qkv 34.82, o 30.66, gate/up 113.96, down 76.14. int8 /
# fp8: no split beat the default. int4 since session 12: swept with SHAPE_TILES (above), which replaces these. An
# entry applies whatever tile a call runs (POLYFUSE_QGEMV_TILES or a sweep's), though it was measured with its own.
PROGRAMS_PER_SM = {
    ("int4", 6144, 4096): 4,
    ("int4", 4096, 4096): 8,
    ("int4", 28672, 4096): 16,
    ("int4", 4096, 14336): 16,
    ("int4", 128256, 4096): 32,
    ("int4", 10240, 8192): 8,
    ("int4", 8192, 8192): 16,
    ("int4", 57344, 8192): 24,
    ("int4", 8192, 28672): 16,
    ("int4_a8", 6144, 4096): 8,
    ("int4_a8", 4096, 4096): 4,
    ("int4_a8", 28672, 4096): 16,
    ("int4_a8", 4096, 14336): 8,
    ("int4_a8", 128256, 4096): 16,
    ("int4_a8", 10240, 8192): 8,
    ("int4_a8", 8192, 8192): 8,
    ("int4_a8", 57344, 8192): 16,
    ("int4_a8", 8192, 28672): 8,
    ("int4_mma", 6144, 4096): 4,
    ("int4_mma", 4096, 14336): 4,
    ("int4_mma", 128256, 4096): 4,
    ("int4_mma", 10240, 8192): 4,
    ("int4_mma", 8192, 8192): 4,
    ("int4_mma", 57344, 8192): 8,
    ("int4_mma", 8192, 28672): 4,
}
# 32-bit registers per thread that a one-row GEMV fills with weights before its PDL wait (prefetch_tiles), per
# format. Measured on one H200 (session 12, decode batch 1, the same model with and
# without, alternating): int4 on every projection 363.8 against 344.3 tok/s (8B), 62.9 against 59.6 (70B); int8 and
# fp8 on every projection 384.1 against 388.8 and 375.5 against 395.4, on 8B qkv / o / down only 384.4 against 388.5
# and 391.5 against 395.3, fp8 on 70B qkv (and o) 55.6-56.5 (56.2) against 56.5: off. With the norm / SwiGLU kernel
# launching the GEMV first too (the int4 pairs; session 15): fp8 379.5 against 392.4, int8 382.0 against 386.3: still
# off. POLYFUSE_GEMV_PREFETCH=0 turns it off.
PREFETCH_REGS = {"int4": 32}
PREFETCH = os.environ.get("POLYFUSE_GEMV_PREFETCH", "1") != "0"
_env = os.environ.get("POLYFUSE_QGEMV_TILES")
if _env:
    TILES.update({k: tuple(v) for k, v in json.loads(_env).items()})
_ENV_FORMATS = set(json.loads(_env)) if _env else set()


def tiles_for(fmt: str, n: int, k: int) -> tuple:
    """The one-row GEMV's tile for an [n, k] weight: POLYFUSE_QGEMV_TILES's entry for the format when set (tuning
    runs), else the projection's swept tile, else the format's."""
    if fmt in _ENV_FORMATS:
        return TILES[fmt]
    return SHAPE_TILES.get((fmt, n, k), TILES[fmt])


# The multi-row GGUF GEMVs (gemv_gguf_a8.py, gemv_gguf_kquant_a8.py): activation rows per launch (llama.cpp's
# mul_mat_vec_q takes up to 8 columns too), and their tiles per (format, rows per launch padded to a power of 2; a
# call's launches all take its first launch's tile), else the format's one-row tile. Session 21 (one H200): 12 tiles (2-8 weight rows a program, 512 / 1024 weights a
# step, 2 / 4 warps) swept at 2, 4, 8 and 16 rows on the four 8B projections; the least summed over them. 16 rows in
# one launch tied dequantize + cuBLAS for Q8_0 / Q4_0 / Q4_1 and lost for the K-quants, so gemv_gguf_a8.MAX_ROWS is 8.
ROWS_PER_LAUNCH = 8
ROW_TILES: dict = {
    ("gguf_q4_0_a8", 2): (2, 1024, 2, 3),
    ("gguf_q4_0_a8", 4): (4, 1024, 4, 3),
    ("gguf_q4_0_a8", 8): (8, 512, 4, 3),
    ("gguf_q4_1_a8", 2): (4, 1024, 2, 3),
    ("gguf_q4_1_a8", 4): (4, 512, 4, 3),
    ("gguf_q4_1_a8", 8): (8, 1024, 2, 3),
    ("gguf_q8_0_a8", 2): (2, 1024, 2, 3),
    ("gguf_q8_0_a8", 4): (8, 512, 4, 3),
    ("gguf_q8_0_a8", 8): (8, 512, 4, 3),
    ("gguf_q4_k_a8", 2): (4, 1024, 2, 3),
    ("gguf_q4_k_a8", 4): (8, 1024, 4, 3),
    ("gguf_q4_k_a8", 8): (8, 1024, 2, 3),
    ("gguf_q5_k_a8", 2): (2, 1024, 2, 3),
    ("gguf_q5_k_a8", 4): (8, 1024, 2, 3),
    ("gguf_q5_k_a8", 8): (8, 1024, 4, 3),
    ("gguf_q6_k_a8", 2): (4, 1024, 2, 3),
    ("gguf_q6_k_a8", 4): (4, 512, 2, 3),
    ("gguf_q6_k_a8", 8): (8, 512, 4, 3),
}


def row_chunks(rows: int, most: int = 0) -> list:
    """(first row, rows, rows padded to a power of 2) of each launch of a multi-row GEMV, ``most`` (else
    ROWS_PER_LAUNCH) rows a launch."""
    most = most or ROWS_PER_LAUNCH
    return [(c, min(most, rows - c), triton.next_power_of_2(min(most, rows - c))) for c in range(0, rows, most)]


def row_tiles(fmt: str, n: int, k: int, rows: int) -> tuple:
    """A GGUF int8-activation GEMV's tile for ``rows`` activation rows: tiles_for's at one row; at more, ROW_TILES's
    entry for the launches' padded rows, else the one-row tile."""
    if rows == 1:
        return tiles_for(fmt, n, k)
    m_pad = row_chunks(rows)[0][2]
    if fmt not in _ENV_FORMATS and (fmt, m_pad) in ROW_TILES:
        return ROW_TILES[(fmt, m_pad)]
    return tiles_for(fmt, n, k)


def programs_per_sm(fmt: str, n: int, k: int) -> int:
    """Programs per multiprocessor for split_k: the projection's measured entry, else two."""
    return PROGRAMS_PER_SM.get((fmt, n, k), 2)


def no_fp8_cvt(device: torch.device) -> bool:
    """A GPU without fp8 conversion instructions (before sm89): the kernels decode e4m3 bits by integer arithmetic."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def dense_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit last stride (the kernels index rows by their first stride)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def split_k(n_programs: int, k_tiles: int, device: torch.device, per_sm: int = 2) -> int:
    """Splits of K so that about ``per_sm`` programs per multiprocessor run (one split when the rows already fill
    them)."""
    want = triton.cdiv(per_sm * sm_count(device), max(n_programs, 1))
    return max(1, min(want, k_tiles))


def split_plan(grid_n: int, units: int, block: int, device, split=None, per_sm: int = 2) -> tuple[int, int]:
    """(splits, units per split) of a one-row launch whose K holds ``units`` (weights, words, blocks) taken ``block`` a
    step: ``split`` (a test's or a sweep's) or split_k's choice, rounded so that every split starts on a step and none
    is empty."""
    steps = triton.cdiv(units, block)
    split = split or split_k(grid_n, steps, device, per_sm)
    per = triton.cdiv(steps, split) * block
    return triton.cdiv(units, per), per


_COUNTERS: dict = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile (GEMM) or column block (GEMV), kept per device; every launch leaves
    them zero again. Allocated once with at least 16384 entries (more column blocks or tiles than any Llama
    projection's launch has: the 8B LM head at 8 columns per block is 16032), so a CUDA graph that captured them keeps
    valid pointers."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 16384), dtype=torch.int32, device=device)
    return buf


def workspace(split: int, m: int, n: int, device) -> torch.Tensor:
    """The float32 partial tiles of a split launch (uninitialised: every partial is written before it is read)."""
    return torch.empty((split, m, n) if split > 1 else (1,), dtype=torch.float32, device=device)


def split_buffers(split: int, n_blocks: int, n: int, device) -> tuple:
    """(workspace, counters) for a one-row launch of ``n_blocks`` column blocks in ``split`` splits. One split
    touches neither: the kept counters stand in for both, so a decode step allocates nothing for them."""
    if split == 1:
        cnt = counters(device, 1)
        return cnt, cnt
    return workspace(split, 1, n, device), counters(device, n_blocks)
