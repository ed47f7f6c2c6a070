"""``add_rms_norm_linear_q`` for one row of int4 weights: the norm's kernel, then the one-row GEMV, launched as a pair
(and for GGUF weights, unless the kernel option ``gguf_a8`` is off: the norm's kernel writes the row quantized to
int8, as for W4A8).

The int4 GEMV loads its first weight tiles before its PDL wait (gemv_common.GemvTiles.prefetch): nothing before it
writes them.
With plain PDL the GEMV may launch only once the norm's kernel has passed its own wait, so those loads overlap just the
norm. Here the norm's kernel lets the GEMV launch first and then waits (_pdl.launch_then_wait): the GEMV's programs are
placed, and start loading weights, while the kernel before the norm (the previous layer's down projection, or the
attention's o projection) still runs. The GEMV still waits for the norm whole before it reads the normalized row, so
the arithmetic and the bits are the composite's (the same two kernels). The SwiGLU kernel before the down projection
does the same (gemv_q.py, PAIRED).

On an H200 (graphed decode at batch 1) this made Llama-3-8B int4 3.8% faster, with the same tokens. For int8 / fp8,
whose GEMVs load nothing before their wait, launching first made the decode slower: they keep the composite's order.
"""

from typing import Optional

import torch

from polyfuse.backends.triton._util import rows
from polyfuse.backends.triton.quant import gemv_gguf_a8, gemv_int4_a8, gemv_q
from polyfuse.backends.triton.quant.act_int8 import norm_quantize_row
from polyfuse.backends.triton.rms_norm import rms_norm_forward
from polyfuse.core.kernel_options import DEFAULT


def accepts_add_rms_norm_linear_q(x, residual, weight, eps, qweight, bias=None, options=DEFAULT) -> Optional[str]:
    gguf_a8 = gemv_gguf_a8.accepts(x, qweight, None, options) and _one_dtype(x, residual, weight)
    if not gemv_q.paired(qweight, options) and not gguf_a8:
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


def add_rms_norm_linear_q(x, residual, weight, eps, qweight, bias=None, options=DEFAULT):
    """(linear_q(norm(x + residual)), x + residual), or with no residual (linear_q(rms_norm(x)), x)."""
    h = x.shape[-1]
    res = None if residual is None else rows(residual, h)
    for a8, natural in ((gemv_int4_a8, False), (gemv_gguf_a8, True)):  # W4A8, GGUF A8: the norm kernel quantizes
        if a8.accepts(x, qweight, None, options) and _one_dtype(x, residual, weight):
            xw, dx, rs, r = norm_quantize_row(rows(x, h), res, weight, eps, natural, options)
            gemv = gemv_int4_a8.gemv_int4_a8 if a8 is gemv_int4_a8 else gemv_gguf_a8.gemv_gguf_a8
            out = gemv((xw, dx, rs), qweight, x.dtype, bias, options=options).view(*x.shape[:-1], qweight.shape[0])
            return out, (x if residual is None else r.view(x.shape))
    y, _, r = rms_norm_forward(rows(x, h), weight, eps, res, early=True, options=options)
    out = gemv_q.linear_q(y.view(x.shape), qweight, bias, options)
    return out, (x if residual is None else r.view(x.shape))
