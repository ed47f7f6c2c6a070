"""``add_rms_norm_linear_q`` for one row of int4 weights: the norm's kernel, then the one-row GEMV, launched as a pair
(and for GGUF weights, unless POLYFUSE_GGUF_A8=0: the norm's kernel writes the row quantized to int8, as for W4A8).

The int4 GEMV loads its first weight tiles before its PDL wait (gemv_common.prefetch_tiles): nothing before it writes them.
With plain PDL the GEMV may launch only once the norm's kernel has passed its own wait, so those loads overlap just the
norm. Here the norm's kernel lets the GEMV launch first and then waits (_pdl.launch_then_wait): the GEMV's programs are
placed, and start loading weights, while the kernel before the norm (the previous layer's down projection, or the
attention's o projection) still runs. The GEMV still waits for the norm whole before it reads the normalized row, so
the arithmetic and the bits are the composite's (the same two kernels). The SwiGLU kernel before the down projection
does the same (gemv_q.py, PAIRED).

One H200, session 14, graphed decode at batch 1 with the head packed, this code on and off (``gemv_q.PAIRED``
emptied) in alternating passes: Llama-3-8B int4 414.4 / 414.6 tok/s against 399.1 / 399.1 (+3.8%), Llama-2-70B int4
69.9 / 69.8 against 68.6 / 68.6, the same greedy tokens. Measured first as a patch of the kernels in separate
processes: the norm and SwiGLU kernels launching first 416.6-417.1 against 398.2-398.7; every small kernel (rotary + KV
write and attention too) 409.3-409.9, so those two keep waiting first. For int8 / fp8, whose GEMVs load nothing before
their wait, every small kernel launching first made the decode slower (fp8 377.3 against 392.1, int8 367.8 against
385.5), and so did these pairs with their GEMVs loading weights early (session 15: fp8 379.5 against 392.4, int8 382.0
against 386.3): they keep the plain order (the composite).
"""

from typing import Optional

import torch

from polyfuse.backends.triton._util import rows
from polyfuse.backends.triton.quant import gemv_gguf_a8, gemv_int4_a8, gemv_q
from polyfuse.backends.triton.quant.act_int8 import norm_quantize_row
from polyfuse.backends.triton.rms_norm import rms_norm_forward


def accepts_add_rms_norm_linear_q(x, residual, weight, eps, qweight, bias=None) -> Optional[str]:
    gguf_a8 = gemv_gguf_a8.accepts(x, qweight) and _one_dtype(x, residual, weight)
    if not gemv_q.paired(qweight) and not gguf_a8:
        return f"{qweight.format}: its GEMV loads no weights before its wait (the composite's order is faster)"
    if residual is not None and residual.shape != x.shape:
        return "x and residual shapes differ"
    grads = weight.requires_grad or x.requires_grad or (residual is not None and residual.requires_grad)
    return gemv_q.accepts_linear_q(x, qweight, bias) or (
        "needs gradients" if torch.is_grad_enabled() and grads else None
    )


def _one_dtype(x, residual, weight) -> bool:
    """The fused norm + int8 quantization takes x, the residual and the norm weight of one dtype (the norm's output
    dtype is then x's), the weight one dense row."""
    same = weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    return same and weight.dim() == 1 and weight.stride(0) == 1


def add_rms_norm_linear_q(x, residual, weight, eps, qweight, bias=None):
    """(linear_q(norm(x + residual)), x + residual), or with no residual (linear_q(rms_norm(x)), x)."""
    h = x.shape[-1]
    if gemv_int4_a8.accepts(x, qweight) and _one_dtype(x, residual, weight):  # W4A8: the norm kernel quantizes
        xw, dx, rs, r = norm_quantize_row(rows(x, h), None if residual is None else rows(residual, h), weight, eps)
        out = gemv_int4_a8.gemv_int4_a8((xw, dx, rs), qweight, x.dtype, bias).view(*x.shape[:-1], qweight.shape[0])
        return out, (x if residual is None else r.view(x.shape))
    if gemv_gguf_a8.accepts(x, qweight) and _one_dtype(x, residual, weight):  # the same, in natural order
        res = None if residual is None else rows(residual, h)
        xw, dx, rs, r = norm_quantize_row(rows(x, h), res, weight, eps, natural=True)
        out = gemv_gguf_a8.gemv_gguf_a8((xw, dx, rs), qweight, x.dtype, bias).view(*x.shape[:-1], qweight.shape[0])
        return out, (x if residual is None else r.view(x.shape))
    y, _, r = rms_norm_forward(rows(x, h), weight, eps, None if residual is None else rows(residual, h), early=True)
    out = gemv_q.linear_q(y.view(x.shape), qweight, bias)
    return out, (x if residual is None else r.view(x.shape))
