"""Projections on int4 / int8 / fp8_block / GGUF weights for many rows (prefill): the weight dequantized once per call
into a scratch tensor in the activations' dtype by one Triton kernel (GGUF blocks: dequant_gguf.py; Q4_K / Q6_K:
dequant_gguf_kquant.py), then ``F.linear`` (cuBLAS on a GPU). Per-channel fp8 too where its e4m3 GEMMs do not take the call (float16 / float32 activations,
GPUs before sm89); elsewhere they do (fp8_scaled_mm, cuda:scaled_mm, ranked below this one), so this declines it.

The dequantized values are the reference's exactly (polyfuse/ops/quant_formats.py ``dequantize``: float32, one
rounding), so this computes what the native reference computes; what it saves is the reference's float32 and int32
temporaries (for int4 several [K, N] tensors of 4 bytes per weight): the kernel reads the packed weight once and
writes 2 bytes per weight (bf16 / fp16). For a 2048-token prefill that write is small beside the GEMM's work. int4
is written [K, N] (the packing's order, coalesced along N) and passed to F.linear transposed; the 1-byte formats
[N, K]. fp8_block (1 x 128 scales, as compressed-tensors' 128 x 128 block checkpoints load: Qwen3's FP8 releases):
its multi-row calls where the block-scaled fp8 GEMM (fp8_block_mm.py, Hopper, 2 rows or more) does not run. The
native reference it replaces builds float32 temporaries of the whole weight (about 20 bytes of traffic per weight
against this kernel's 3).
Registered below the dequantizing GEMM (gemm_q.py), which takes the few-row calls; inference only.
"""

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.backends.triton.quant.gemm_common import BYTE_KINDS, byte_tile, int4_tile
from polyfuse.backends.triton.quant.gemm_int4 import int4_block_k
from polyfuse.backends.triton.quant.gemv_common import dense_rows, no_fp8_cvt
from polyfuse.ops.quant_formats import GGUF_BYTES, K_QUANTS
from polyfuse.ops.quant_linear import scaled_mm_refusal


FORMATS = ("int4", "int8", "fp8", "fp8_block", *GGUF_BYTES)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE = (64, 128, 4)  # block_n, block_k, num_warps


@triton.jit
def _dequant_kernel(
    QW, QZ, S, GI, WD, N, K, G_SIZE, sq, sz_g, ss_g, sd,
    INT4: tl.constexpr, GATHER: tl.constexpr, RESHAPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    KIND: tl.constexpr = 0, BLOCKED: tl.constexpr = False,
):  # fmt: skip
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    mask = (k < K)[:, None] & n_mask[None, :]
    if INT4:  # into [K, N]
        w = int4_tile(QW, QZ, S, GI, k0, K, cols, n_mask, k0 // G_SIZE, sq, sz_g, ss_g,
                      GATHER, RESHAPE, BLOCK_K, BLOCK_N)  # fmt: skip
        tl.store(WD + k[:, None].to(tl.int64) * sd + cols[None, :], cast_rne(w, WD.dtype.element_ty), mask=mask)
    else:  # into [N, K]; KIND as in BYTE_KINDS; BLOCKED: fp8_block, one scale per row and 128 columns (one K tile)
        if BLOCKED:
            tl.static_assert(BLOCK_K == 128, "fp8_block: one K tile per scale")
            s = tl.load(S + cols * ss_g + k0 // BLOCK_K, mask=n_mask, other=0.0).to(tl.float32)
        else:
            s = tl.load(S + cols, mask=n_mask, other=0.0).to(tl.float32)
        w = byte_tile(QW, s, k0, K, cols, n_mask, sq, KIND, BLOCK_K)
        tl.store(WD + cols[None, :] * sd + k[:, None], cast_rne(w, WD.dtype.element_ty), mask=mask)


def dequantize_q(qw, dtype: torch.dtype) -> torch.Tensor:
    """dequantize(qw, dtype) by one kernel: the [N, K] weight (int4: a transposed view of a [K, N] tensor)."""
    n, k = qw.shape
    if qw.format in K_QUANTS:
        from polyfuse.backends.triton.quant.dequant_gguf_kquant import dequantize_kquant

        return dequantize_kquant(qw, dtype)
    if qw.format.startswith("gguf"):
        from polyfuse.backends.triton.quant.dequant_gguf import dequantize_gguf

        return dequantize_gguf(qw, dtype)
    block_n, block_k, num_warps = TILE
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    if qw.format == "int4":
        block_k, gather = int4_block_k(qw, block_k)
        grid = (grid[0], triton.cdiv(k, block_k))
        wd = torch.empty((k, n), dtype=dtype, device=qw.device)
        qweight, qzeros, scales, g_idx = (dense_rows(t) for t in (qw.qweight, qw.qzeros, qw.scales, qw.g_idx))
        _dequant_kernel[grid](
            qweight, qzeros, scales, g_idx, wd, n, k, qw.group_size, qweight.stride(0), qzeros.stride(0),
            scales.stride(0), wd.stride(0),
            INT4=True, GATHER=gather, RESHAPE=False, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        )  # fmt: skip
        return wd.t()
    wd = torch.empty((n, k), dtype=dtype, device=qw.device)
    w, scales = dense_rows(qw.qweight), dense_rows(qw.scales)
    kind = BYTE_KINDS["int8" if qw.format == "int8" else "fp8"]
    if kind and no_fp8_cvt(w.device):  # a GPU without fp8 conversions: the e4m3 bits decoded by integer arithmetic
        w, kind = w.view(torch.uint8), BYTE_KINDS["fp8_bits"]
    _dequant_kernel[grid](
        w, w, scales, w, wd, n, k, 1, w.stride(0), 0, scales.stride(0), wd.stride(0),
        INT4=False, GATHER=False, RESHAPE=False, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        KIND=kind, BLOCKED=qw.format == "fp8_block",
    )  # fmt: skip
    return wd


def accepts_linear_q(x, qweight, bias=None) -> Optional[str]:
    n, k = qweight.shape
    if x.shape[-1] != k or x.numel() == 0:
        return "no rows of K inputs"
    if qweight.format not in FORMATS:
        return f"no dequantize kernel for format {qweight.format}"
    if qweight.format == "fp8" and scaled_mm_refusal(x, qweight) is None and not (x.is_cuda and no_fp8_cvt(x.device)):
        return "per-channel fp8 with bfloat16 activations: its e4m3 GEMM takes them"
    if x.dtype not in DTYPES:
        return f"activation dtype {str(x.dtype).replace('torch.', '')} unsupported"
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return "needs gradients"
    return None


def linear_q(x, qweight, bias=None):
    return F.linear(x, dequantize_q(qweight, x.dtype), bias)
