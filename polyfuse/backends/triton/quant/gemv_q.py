"""The Triton implementations of ``linear_q`` / ``swiglu_linear_q``: a one-row GEMV that reads the packed weight and
dequantizes in its loads (for ``swiglu_linear_q`` with SwiGLU folded into the activation loads, or for the PAIRED
formats SwiGLU's own kernel launched to let the GEMV start first), one kernel per layout (gemv_int8_fp8.py: int8 /
fp8 / fp8_block; gemv_int4.py: int4, or gemv_int4_a8.py on int8 activations with the kernel option ``int4_a8``;
gemv_gguf.py: GGUF Q8_0 / Q4_0 / Q4_1; gemv_gguf_kquant.py: GGUF Q4_K / Q5_K / Q6_K; or gemv_gguf_a8.py on int8
activations for every GGUF type unless the option ``gguf_a8`` is off). Anything else (more than one row, a format
without a kernel, gradients) is declined to the registry's next choice (the native reference: dequantize +
``F.linear``, i.e. cuBLAS on a GPU)."""

from typing import Optional

import torch

from polyfuse.backends.triton.quant import gemv_gguf_a8, gemv_int4_a8
from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.quant_formats import GGUF_BYTES, K_QUANTS


SCALED = ("int8", "fp8", "fp8_block")
FORMATS = (*SCALED, "int4", *GGUF_BYTES)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_refusal(x: torch.Tensor, qweight, bias, formats, kernel: str) -> Optional[str]:
    """What every quantized Triton kernel (this GEMV, gemm_q.py's GEMM) declines: a format it has no kernel
    for, another activation dtype, a call that needs gradients (inference only)."""
    if qweight.format not in formats:
        return f"no {kernel} for format {qweight.format}"
    if x.dtype not in DTYPES:
        return f"activation dtype {str(x.dtype).replace('torch.', '')} unsupported"
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return "needs gradients"
    return None


def _refusal(x: torch.Tensor, qweight, bias) -> Optional[str]:
    n, k = qweight.shape
    if x.shape[-1] != k or x.numel() != k:
        return "not a one-row projection"
    return kernel_refusal(x, qweight, bias, FORMATS, "GEMV")


def accepts_linear_q(x, qweight, bias=None, options=DEFAULT) -> Optional[str]:
    return _refusal(x, qweight, bias)


# Formats whose GEMV with SwiGLU folded into the activation load was slower on the H200 than the separate SwiGLU
# kernel + the plain GEMV (the fold recomputes silu in every program): declined to the composite.
NO_FOLD = ("int4", "int8", "fp8")


# Formats whose one-row GEMV loads weights before its PDL wait (gemv_common.GemvTiles.prefetch): their
# swiglu_linear_q runs the SwiGLU kernel, which lets the GEMV launch before it waits (_pdl.launch_then_wait), then
# the GEMV, rather than the fold (norm_gemv_q.py: the same for the norm before q/k/v and gate/up). Only where the
# launch really loads early (``paired``): not act-order int4, nor with a table's prefetch_regs 0.
PAIRED = ("int4",)


def paired(qweight, options=DEFAULT) -> bool:
    """Whether the one-row GEMV on ``qweight`` is launched after a kernel that lets it launch first."""
    if qweight.format not in PAIRED:
        return False
    from polyfuse.backends.triton.quant.gemv_int4 import loads_early

    return loads_early(qweight, options)


def accepts_swiglu_linear_q(gate, up, qweight, bias=None, options=DEFAULT) -> Optional[str]:
    if up.shape != gate.shape:
        return "gate and up shapes differ"
    if qweight.format in NO_FOLD and gate.is_cuda and not paired(qweight, options):
        return f"{qweight.format}: the separate SwiGLU + GEMV is faster (measured)"
    return _refusal(gate, qweight, bias) or (_refusal(up, qweight, None) if up.requires_grad else None)


def _row(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _gemv(x, up, qweight, bias, options):
    fmt = qweight.format
    if fmt == "int4" and gemv_int4_a8.accepts(x, qweight, up, options):  # W4A8: int8 activations
        from polyfuse.backends.triton.quant.act_int8 import quantize_row

        xq = quantize_row(_row(x), None if up is None else _row(up), options=options)
        return gemv_int4_a8.gemv_int4_a8(xq, qweight, x.dtype, bias, options=options)
    if gemv_gguf_a8.accepts(x, qweight, up, options):  # GGUF on int8 activations
        from polyfuse.backends.triton.quant.act_int8 import quantize_row

        xq = quantize_row(_row(x), None if up is None else _row(up), natural=True, options=options)
        return gemv_gguf_a8.gemv_gguf_a8(xq, qweight, x.dtype, bias, options=options)
    if fmt in SCALED:
        from polyfuse.backends.triton.quant.gemv_int8_fp8 import gemv_int8_fp8 as kernel
    elif fmt == "int4":
        from polyfuse.backends.triton.quant.gemv_int4 import gemv_int4 as kernel
    elif fmt in K_QUANTS:
        from polyfuse.backends.triton.quant.gemv_gguf_kquant import gemv_gguf_kquant as kernel
    else:
        from polyfuse.backends.triton.quant.gemv_gguf import gemv_gguf as kernel
    return kernel(_row(x), None if up is None else _row(up), qweight, bias, options=options)


def linear_q(x, qweight, bias=None, options=DEFAULT):
    return _gemv(x, None, qweight, bias, options).view(*x.shape[:-1], qweight.shape[0])


def swiglu_linear_q(gate, up, qweight, bias=None, options=DEFAULT):
    if paired(qweight, options) and not gemv_int4_a8.accepts(gate, qweight, up, options):
        # the SwiGLU kernel launching the GEMV first, then the GEMV: the composite's bits (W4A8 quantizes after
        # SwiGLU in one kernel instead)
        from polyfuse.backends.triton.swiglu import swiglu_forward

        h = swiglu_forward(gate, up, early=True, options=options)
        return _gemv(h, None, qweight, bias, options).view(*gate.shape[:-1], qweight.shape[0])
    return _gemv(gate, up, qweight, bias, options).view(*gate.shape[:-1], qweight.shape[0])
