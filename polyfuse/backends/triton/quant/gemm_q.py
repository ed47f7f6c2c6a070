"""The Triton dequantizing GEMM as ``linear_q`` / ``swiglu_linear_q`` for a few rows (batch decode): int4
(gemm_int4.py; 2..16 rows with in-order groups: gemm_int4_mma.py, the packed nibbles as tensor-core operands), int8
and fp8 per channel (gemm_int8_fp8.py) weights, dequantized in the loads, SwiGLU folded into the activation loads.
GGUF types kept as stored: 2..gemv_gguf_a8.MAX_ROWS (8) rows with the kernel option ``gguf_a8`` (on by default): the
rows quantized to int8 in blocks of 32 (SwiGLU in that kernel), then the GGUF GEMV with every launch reading the
weight once for up to 8 rows (gemv_gguf_a8.py / gemv_gguf_kquant_a8.py), as llama.cpp's mul_mat_vec_q for a few columns;
more rows (or the path off), up to GGUF_GEMM's rows for Q4_0 / Q4_1 (64), Q8_0 / Q4_K (32): gemm_gguf.py, the
blocks dequantized in the loads and multiplied on the tensor cores.

It takes MIN_ROWS .. MAX_ROWS rows; one row is the GEMV's (gemv_q.py, ranked above), more rows than MAX_ROWS
(prefill), other formats, other dtypes and calls that need gradients are declined to the registry's next choice
(for linear_q: dequant_mm.py, one dequantize kernel + cuBLAS, for int4 / int8; triton:fp8_scaled_mm, then
cuda:scaled_mm, for fp8; then the native reference; for swiglu_linear_q: triton:fp8_scaled_mm for fp8, then the
composite swiglu + linear_q).
"""

from typing import Optional

import torch

from polyfuse.backends.triton._util import rows
from polyfuse.backends.triton.quant import gemv_gguf_a8
from polyfuse.backends.triton.quant.gemv_q import kernel_refusal
from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.quant_formats import GGUF_BYTES


# GGUF types whose dequantizing GEMM (gemm_gguf.py) beat dequantize + cuBLAS on one H200, and the most rows it takes
# for each; Q5_K and Q6_K lost at every row count: their rows past the int8-activation GEMV go to dequant_mm.py.
GGUF_GEMM = {"gguf_q4_0": 64, "gguf_q4_1": 64, "gguf_q8_0": 32, "gguf_q4_k": 32}
FORMATS = ("int4", "int8", "fp8", *GGUF_GEMM)
# Rows the GEMM takes: all rows of a decode batch fit one BLOCK_M <= 64 tile (the weight is read once per call).
MIN_ROWS, MAX_ROWS = 2, 64


def _refusal(x: torch.Tensor, qweight, bias, options) -> Optional[str]:
    n, k = qweight.shape
    if qweight.format in GGUF_BYTES and gemv_gguf_a8.accepts_rows(x, qweight, None, options):
        return kernel_refusal(x, qweight, bias, GGUF_BYTES, "GEMM")
    if x.shape[-1] != k:
        return "input width is not the weight's K"
    m = x.numel() // max(k, 1)
    if m < MIN_ROWS:
        return "one row (the GEMV's)" if m == 1 else "no rows"
    if m > MAX_ROWS:
        return f"more than {MAX_ROWS} rows"
    if qweight.format in GGUF_GEMM and m > GGUF_GEMM[qweight.format]:
        return f"GGUF: more than {GGUF_GEMM[qweight.format]} rows (dequantize + cuBLAS is faster, measured)"
    return kernel_refusal(x, qweight, bias, FORMATS, "GEMM")


def accepts_linear_q(x, qweight, bias=None, options=DEFAULT) -> Optional[str]:
    return _refusal(x, qweight, bias, options)


def accepts_swiglu_linear_q(gate, up, qweight, bias=None, options=DEFAULT) -> Optional[str]:
    if up.shape != gate.shape or up.dtype != gate.dtype:
        return "gate and up differ in shape or dtype"
    if qweight.format in GGUF_BYTES and gemv_gguf_a8.accepts_rows(gate, qweight, up, options):  # SwiGLU: quantizer
        return kernel_refusal(gate, qweight, bias, GGUF_BYTES, "GEMM") or (
            "needs gradients" if up.requires_grad and torch.is_grad_enabled() else None
        )
    if gate.is_cuda:  # H200, 8B down projection: the fold took 187 us (int4) / 70 us (int8) against 50 / 28 without
        return "the separate SwiGLU + GEMM is faster (measured)"
    return _refusal(gate, qweight, bias, options) or (
        _refusal(up, qweight, None, options) if up.requires_grad else None
    )


def _gemm(x, up, qweight, bias, options):
    k = qweight.shape[1]
    if qweight.format in GGUF_BYTES:
        if gemv_gguf_a8.accepts_rows(x, qweight, up, options):  # rows quantized to int8 (SwiGLU first), then the GEMV
            from polyfuse.backends.triton.quant.act_int8 import quantize_rows

            xq = quantize_rows(rows(x, k), None if up is None else rows(up, k), natural=True, options=options)
            return gemv_gguf_a8.gemv_gguf_a8(xq, qweight, x.dtype, bias, options=options)
        from polyfuse.backends.triton.quant.gemm_gguf import gemm_gguf as kernel
    elif qweight.format == "int4":
        from polyfuse.backends.triton.quant import gemm_int4_mma

        if gemm_int4_mma.accepts(x, up, qweight, options):  # up to 16 rows: the tensor-core GEMM
            return gemm_int4_mma.gemm_int4_mma(rows(x, k), qweight, bias, options=options)
        from polyfuse.backends.triton.quant.gemm_int4 import gemm_int4 as kernel
    else:
        from polyfuse.backends.triton.quant.gemm_int8_fp8 import gemm_int8_fp8 as kernel
    return kernel(rows(x, k), None if up is None else rows(up, k), qweight, bias, options=options)


def linear_q(x, qweight, bias=None, options=DEFAULT):
    return _gemm(x, None, qweight, bias, options).view(*x.shape[:-1], qweight.shape[0])


def swiglu_linear_q(gate, up, qweight, bias=None, options=DEFAULT):
    return _gemm(gate, up, qweight, bias, options).view(*gate.shape[:-1], qweight.shape[0])
