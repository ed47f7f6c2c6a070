"""Shared pieces of the quantized one-row GEMVs (gemv_int8_fp8.py, gemv_int4.py, gemv_gguf*.py, ...): the activation
load with SwiGLU folded in, the fp8 bit decoding for GPUs without fp8 conversions, the tuned tiles (configs/qgemv)
and the split-K launch."""

import functools

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton import tuned
from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.backends.triton._util import sm_count
from polyfuse.core.kernel_options import DEFAULT


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
    programs and 16 for larger ones (its 1-warp programs split K 17-66 ways; more partials per round measured faster
    on an H200 but for the programs with many columns per thread, which tail_regs keeps at 4-5)."""
    return tail_unroll(block_n, num_warps, tail_regs(per_sm, num_warps), 32 if num_warps == 1 else 16)


@triton.jit
def weight_tile(ptrs, mask, other, EARLY: tl.constexpr):
    """A GEMV's weight tile; EARLY: loaded before the PDL wait (prefetch_tiles), past L1."""
    if EARLY:
        w = tl.load(ptrs, mask=mask, other=other, cache_modifier=".cg")
    else:
        w = tl.load(ptrs, mask=mask, other=other)
    return w


# ---- launch choices: the tuned table (configs/qgemv, tuned.py) ----------------------------------------------------

# Activation rows per launch of the multi-row GGUF GEMVs (gemv_gguf_a8.py, gemv_gguf_kquant_a8.py), as llama.cpp's
# mul_mat_vec_q takes up to 8 columns.
ROWS_PER_LAUNCH = 8


def _shapes(entry: dict, name: str) -> dict:
    return {tuned.shape_key(s): (tuple(v) if isinstance(v, list) else v) for s, v in entry.get(name, {}).items()}


class GemvTiles:
    """One GPU's qgemv table, parsed. Per format: ``tile`` (block_n, block_k, num_warps, num_stages; block_k counts
    weights along K: int4 a multiple of 8, GGUF of 32, the K-quants a power-of-2 multiple of 256; num_stages: the K
    loop's pipelining depth), ``shapes`` ("N,K": a projection's own tile), ``programs_per_sm`` ("N,K": what the K
    split aims at, else 2), ``prefetch_regs`` (32-bit registers per thread of weights loaded before the PDL wait,
    else 0) and ``rows`` (the multi-row GGUF GEMVs' tile per launch's rows padded to a power of 2)."""

    def __init__(self, table: dict):
        self.formats = {fmt: tuple(e["tile"]) for fmt, e in table.items()}
        self.shapes = {fmt: _shapes(e, "shapes") for fmt, e in table.items()}
        self.per_sm = {fmt: _shapes(e, "programs_per_sm") for fmt, e in table.items()}
        self.rows = {fmt: {int(m): tuple(v) for m, v in e.get("rows", {}).items()} for fmt, e in table.items()}
        self.prefetch_regs = {fmt: int(e.get("prefetch_regs", 0)) for fmt, e in table.items()}

    def tile(self, fmt: str, n: int, k: int) -> tuple:
        """The one-row GEMV's tile for an [n, k] weight: the projection's, else the format's."""
        return self.shapes[fmt].get((n, k), self.formats[fmt])

    def row_tile(self, fmt: str, n: int, k: int, rows: int) -> tuple:
        """A GGUF int8-activation GEMV's tile for ``rows`` activation rows: ``tile``'s at one row; at more, the
        format's entry for the launches' padded rows, else the one-row tile."""
        if rows > 1:
            found = self.rows[fmt].get(row_chunks(rows)[0][2])
            if found is not None:
                return found
        return self.tile(fmt, n, k)

    def programs_per_sm(self, fmt: str, n: int, k: int) -> int:
        """Programs per multiprocessor for split_k: the projection's entry, else two."""
        return self.per_sm.get(fmt, {}).get((n, k), 2)

    def prefetch(self, fmt: str, tile_regs: float) -> int:
        """Tiles of weights a one-row GEMV program loads before its PDL wait (no kernel before it writes them, so
        they may stream while that kernel still runs): as many as the format's ``prefetch_regs`` hold, at most 2;
        ``tile_regs``: one tile's."""
        return int(max(0, min(2, self.prefetch_regs.get(fmt, 0) // max(tile_regs, 1))))


@functools.lru_cache(maxsize=None)
def _tiles(device_name: str, override: str) -> GemvTiles:
    return GemvTiles(tuned.table("qgemv", device_name, override))


def gemv_tiles(device, options=DEFAULT) -> GemvTiles:
    """The qgemv table of ``device``'s GPU (configs/qgemv: its own file, else the default), with the run's
    ``tile_configs`` over it."""
    return _tiles(tuned.gpu_name(device), options.tile_configs)


def row_chunks(rows: int, most: int = 0) -> list:
    """(first row, rows, rows padded to a power of 2) of each launch of a multi-row GEMV, ``most`` (else
    ROWS_PER_LAUNCH) rows a launch."""
    most = most or ROWS_PER_LAUNCH
    return [(c, min(most, rows - c), triton.next_power_of_2(min(most, rows - c))) for c in range(0, rows, most)]


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
