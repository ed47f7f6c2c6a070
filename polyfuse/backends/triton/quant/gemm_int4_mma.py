"""int4 weights in AutoGPTQ's layout times 2..16 rows (batch decode), the products on the tensor cores.

The CUDA-core kernels (gemv_int4.py for one row, gemm_int4.py for more) spend several instructions per weight (a
byte permute and an FMA, or a float dequantization and a rounding, per weight); here a weight costs about one logic
instruction. qweight [K/8, N] words are copied to shared memory by the software pipeline and read back in the tensor
core's operand layout (Triton hoists the decode past the layout change: two consecutive words per register pair),
where one byte permute per two words and a shift + LOP3 per two weights put nibble i of both words under the top
mantissa bits of 1.0: the bf16 (or fp16) pair 1 + q / 16, exact. Each 128-weight tile is eight [16, 16] x
[16, BLOCK_N] products, one per nibble plane (plane i holds the weights k = 8 k8 + i; the other operand holds the
call's rows, zeros below), so the tile's sum is t = sum (1 + q / 16) x in float32. A tile lies in one group (the
group size a multiple of 128): it is scaled by its column's scale, and per group s (sum q x - z sum x) =
16 s t - (16 + z) s sum x, the second term once per group and column after the loop (z: AutoGPTQ's stored zero plus
one). The offset 1 against q / 16 <= 15/16 keeps the cancellation small (a few bits); with q in the low mantissa
bits (128 + q in bf16, 1024 + q in fp16: the first version) fp16 activations with a nonzero mean lost accuracy over
long K. The dequantized weight is never rounded to the activations' dtype (as in the one-row GEMV).

The activations are first rewritten plane by plane (_plane_major_kernel, one small launch), so that plane i's 16
values are contiguous and ride the pipeline with the weights; read in place, every eighth value, each plane's operand
went through registers and shared memory with a barrier. On an H200 at 16 rows that took the 8B gate/up from 50.1 to
36.1 us and the decode at batch 16 from 3266 to 4292 tok/s. SPLIT > 1 splits K over programs; the tile's last
program adds the partials in split order (gemm_common.store_tile). Under the CPU interpreter (no bf16 products there) the
planes and activations are float32: the same exact products. One row stays on gemv_int4.py: it was as fast or
faster there on every Llama projection.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._rounding import PTX
from polyfuse.backends.triton.quant.gemm_common import store_tile
from polyfuse.backends.triton.quant.gemv_common import (
    counters,
    dense_rows,
    gemv_tiles,
    int4_group_term,
    split_plan,
    workspace,
)
from polyfuse.core.kernel_options import DEFAULT


TILE_K = 128  # weights along K per tile: 16 words of 8 nibbles (the mma's K of 16 per plane)


def _planes_asm(mask: str, magic: str, shifts: tuple) -> str:
    """PTX for pack 2 (two words per call, as the operand layout holds them): the low halves of both words side by
    side (one permute), the high halves (another); plane i is ((half-pair shifted) & mask) | magic, a shift and a LOP3
    per two weights (shifts[i]: positive left, negative right)."""
    lines = ["{", ".reg .b32 lo, hi, t;", "prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    for i, sh in enumerate(shifts):
        for src, out in (("lo", i), ("hi", i + 4)):
            op = f"shl.b32 t, {src}, {sh};" if sh >= 0 else f"shr.u32 t, {src}, {-sh};"
            lines += [op, f"lop3.b32 ${out}, t, {mask}, {magic}, 0xEA;"]
    return "\n".join(lines + ["}"])


# Nibble i of a half word (bits 4i .. 4i + 3) moved under the top mantissa bits of 1.0: bf16 bits 3..6 of 0x3F80,
# fp16 bits 6..9 of 0x3C00; either way the value is 1 + q / 16, exact.
_PLANES_BF16 = tl.constexpr(_planes_asm("0x00780078", "0x3F803F80", (3, -1, -5, -9)))
_PLANES_FP16 = tl.constexpr(_planes_asm("0x03C003C0", "0x3C003C00", (6, 2, -2, -6)))


@triton.jit
def _planes(words, ASM: tl.constexpr, FP16: tl.constexpr):
    """The eight nibble planes of int32 words as the exact 1 + q / 16 (bf16 or fp16; float32 under the
    interpreter). Plane i holds nibble i (bits 4i .. 4i + 3) of each word."""
    if ASM:
        if FP16:
            p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
                asm=_PLANES_FP16, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r", args=[words],
                dtype=(tl.float16,) * 8, is_pure=True, pack=2,
            )  # fmt: skip
        else:
            p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
                asm=_PLANES_BF16, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r", args=[words],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2,
            )  # fmt: skip
    else:
        p0 = (words & 15).to(tl.float32) * 0.0625 + 1.0
        p1 = ((words >> 4) & 15).to(tl.float32) * 0.0625 + 1.0
        p2 = ((words >> 8) & 15).to(tl.float32) * 0.0625 + 1.0
        p3 = ((words >> 12) & 15).to(tl.float32) * 0.0625 + 1.0
        p4 = ((words >> 16) & 15).to(tl.float32) * 0.0625 + 1.0
        p5 = ((words >> 20) & 15).to(tl.float32) * 0.0625 + 1.0
        p6 = ((words >> 24) & 15).to(tl.float32) * 0.0625 + 1.0
        p7 = ((words >> 28) & 15).to(tl.float32) * 0.0625 + 1.0
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _xtile(xp, r_mask, ASM: tl.constexpr):
    """[16, 16] activation operand: the tile's x for one plane in the call's rows, zeros below."""
    x = tl.load(xp, mask=r_mask, other=0.0)
    if not ASM:
        x = x.to(tl.float32)
    return x


@triton.jit
def _plane_major_kernel(X, XP, K, sx_m, TILES: tl.constexpr, PDL: tl.constexpr):
    """XP[row, 128 t + 16 i + j] = X[row, 128 t + 8 j + i]: each 128-wide tile of a row plane by plane, so the GEMM
    reads a plane's 16 activations contiguously (pipelined copies) instead of every eighth value."""
    wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * TILES + tl.arange(0, TILES)[:, None, None]
    j = tl.arange(0, 16)[None, :, None]
    i = tl.arange(0, 8)[None, None, :]
    m = (t < K // 128) & (j < 16) & (i < 8)
    v = tl.load(X + row * sx_m + t * 128 + j * 8 + i, mask=m)
    tl.store(XP + row * K + t * 128 + i * 16 + j, v, mask=m)


@triton.jit
def _gemv_gptq_mma_kernel(
    X, QW, QZ, S, B, Y, WS, CNT, M, N, K8, G_SIZE, sx_m, sy_m, sq_k, sz_g, ss_g, k8_per_split, SPLIT,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
    ASM: tl.constexpr, FP16: tl.constexpr, XBLOCK: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    zshift = (n % 8) * 4
    k8_start = tl.program_id(2) * k8_per_split
    k8_end = tl.minimum(K8, k8_start + k8_per_split)
    kk8 = tl.arange(0, 16)
    rows = tl.arange(0, 16)
    r_mask = rows < M
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k80 in tl.range(k8_start, k8_end, 16, num_stages=STAGES):
        k8 = k80 + kk8
        words = tl.load(QW + k8[:, None] * sq_k + n[None, :], mask=n_mask[None, :], other=0)
        s = tl.load(S + ((k80 * 8) // G_SIZE) * ss_g + n, mask=n_mask, other=0.0).to(tl.float32)
        p0, p1, p2, p3, p4, p5, p6, p7 = _planes(words, ASM, FP16)
        xm = r_mask[:, None]
        xp = X + rows[:, None] * sx_m + k80 * 8 + kk8[None, :]  # X plane-major: plane i's 16 values contiguous
        t = tl.dot(_xtile(xp, xm, ASM), p0)
        t = tl.dot(_xtile(xp + 16, xm, ASM), p1, t)
        t = tl.dot(_xtile(xp + 32, xm, ASM), p2, t)
        t = tl.dot(_xtile(xp + 48, xm, ASM), p3, t)
        t = tl.dot(_xtile(xp + 64, xm, ASM), p4, t)
        t = tl.dot(_xtile(xp + 80, xm, ASM), p5, t)
        t = tl.dot(_xtile(xp + 96, xm, ASM), p6, t)
        t = tl.dot(_xtile(xp + 112, xm, ASM), p7, t)
        acc += t * s[None, :]
    # t = sum (1 + q / 16) x per tile, so a group's s (sum q x - z sum x) = 16 s t - (16 + z) s sum x: the second
    # term once per group and column, from the group's activation sum over this split's part of it
    acc = acc * 16.0
    k_lo = k8_start * 8
    k_hi = k8_end * 8
    xb = tl.arange(0, XBLOCK)
    for g in range(k_lo // G_SIZE, tl.cdiv(k_hi, G_SIZE)):
        g_lo = tl.maximum(g * G_SIZE, k_lo)
        g_hi = tl.minimum(g * G_SIZE + G_SIZE, k_hi)
        xg = tl.zeros([16, XBLOCK], dtype=tl.float32)
        for c in range(g_lo, g_hi, XBLOCK):
            cm = r_mask[:, None] & (c + xb < g_hi)[None, :]
            xg += tl.load(X + rows[:, None] * sx_m + c + xb[None, :], mask=cm, other=0.0).to(tl.float32)
        acc -= tl.sum(xg, axis=1)[:, None] * int4_group_term(S, QZ, g, n, n_mask, zshift, ss_g, sz_g)[None, :]
    store_tile(acc, Y, B, WS, CNT, rows, n, r_mask, n_mask, M, N, sy_m, HAS_BIAS, SPLIT, 16, BLOCK_N)


# One row stays on gemv_int4.py (as fast or faster on every Llama projection on an H200); 16: the mma tile's rows.
MIN_ROWS, MAX_ROWS = 2, 16


def accepts(x: torch.Tensor, up, qw, options=DEFAULT) -> bool:
    """Whether this kernel takes the call: the run's ``int4_mma`` option on (off: gemm_int4.py), 2..16 rows, in-order groups of a multiple of 128 weights, K a multiple of
    128, no SwiGLU fold, fp16/bf16 activations, a GPU with bf16 tensor cores (sm80+) or the CPU interpreter."""
    n, k = qw.shape
    if (
        not options.int4_mma
        or up is not None
        or qw.act_order
        or qw.group_size <= 0
        or qw.group_size % TILE_K
        or k % TILE_K
    ):
        return False
    if torch.version.hip is not None:  # no PTX there, and the float32-plane path was never measured on ROCm
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or not MIN_ROWS <= x.numel() // k <= MAX_ROWS:
        return False
    return x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) >= (8, 0)


def gemm_int4_mma(x, qw, bias=None, tiles=None, split=None, options=DEFAULT):
    """x [M, K] (M <= 16, unit column stride) @ dequantize(qw).T -> [M, N] in x's dtype (+ bias); ``accepts``
    must hold."""
    n, k = qw.shape
    m = x.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemm_int4_mma: 1..{MAX_ROWS} rows, not {m}")
    table = gemv_tiles(x.device, options)
    block_n, _, num_warps, num_stages = tiles or table.tile("int4_mma", n, k)
    k8 = k // 8
    grid_n = triton.cdiv(n, block_n)
    split, per = split_plan(grid_n, k8, TILE_K // 8, x.device, split, table.programs_per_sm("int4_mma", n, k))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = workspace(split, m, n, x.device)
    cnt = counters(x.device, grid_n)
    qweight, qzeros, scales = (dense_rows(t) for t in (qw.qweight, qw.qzeros, qw.scales))
    xp = torch.empty((m, k), dtype=x.dtype, device=x.device)
    tiles_per_program = 8
    _plane_major_kernel[(m, triton.cdiv(k // TILE_K, tiles_per_program))](
        x, xp, k, x.stride(0), TILES=tiles_per_program, num_warps=4, **pdl_options(x.device, options)
    )
    x = xp
    _gemv_gptq_mma_kernel[(grid_n, 1, split)](
        x, qweight, qzeros, scales, bias if bias is not None else y, y, ws, cnt, m, n, k8, qw.group_size,
        x.stride(0), y.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), per, split,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, STAGES=num_stages, ASM=PTX,
        FP16=x.dtype == torch.float16, XBLOCK=128, num_warps=num_warps, num_stages=num_stages,
        **pdl_options(x.device, options),
    )  # fmt: skip
    return y
