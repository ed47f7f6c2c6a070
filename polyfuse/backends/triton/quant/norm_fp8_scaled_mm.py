"""The layer's input norm fused with the fp8 projection's activation quantization (``add_rms_norm_linear_q`` for
prefill on per-channel fp8 weights): one kernel reads x (and the residual), writes the sum ``x + residual`` (the next
residual) and the normalized rows quantized to e4m3 per token with their float32 scales; then ``torch._scaled_mm``
with row-wise scales (ops/quant_linear.py ``scaled_mm_rows``).

Separately, the norm kernel writes the normalized rows in bfloat16 and the quantizing kernel reads them back (on the
8B shape at 2048 tokens, 16 MB each way, twice per layer) and each is one more launch. The arithmetic is the two
kernels' (backends/triton/rms_norm.py, then scaled_mm.py): the sum rounded to its dtype before the statistics, the
normalized value rounded to that dtype, times the weight rounded again, then the row's amax and the e4m3 rounding.
Under the interpreter the quantized bytes and scales equal ``quantize_rows(add_rms_norm(x, residual)[0])``
(tests/test_norm_quantize.py); on the GPU this kernel's threads hold a row's elements in another layout than the
norm kernel's, so the float32 sum of squares may be added in another order and a rare normalized value round the
other way (the test bounds that there).

Takes what ``triton:fp8_scaled_mm`` takes for ``linear_q`` (per-channel fp8, bfloat16, more than MAX_GEMM_ROWS rows,
rows of at most MAX_K) with x, the residual and the norm weight of one dtype; declines the rest to the composite (the
run's norm, then its ``linear_q``), and is not chosen where the run sets the norm or ``linear_q`` otherwise
(register.py ``probe_norm_scaled_mm``).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.backends.triton._util import rows
from polyfuse.backends.triton.quant.fp8_scaled_mm import _store_quantized_rows, accepts_linear_q, launch_quantizing
from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.quant_linear import scaled_mm_rows


# (rows per program, warps) by the row's power-of-two length: one row per program (H200, 2048 rows: 7-8% less time
# than the quantizing kernel's tiles).
TILES = {4096: (1, 4), 8192: (1, 8)}


@triton.jit
def _add_rms_norm_quantize_kernel(
    X, RES, R, W, Q, S, M, H, sx, sres, sr, sq, eps, HAS_RES: tl.constexpr, FP8_MAX: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HW_CVT: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    mask = (r[:, None] < M) & (k[None, :] < H)
    x = tl.load(X + r[:, None] * sx + k[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(RES + r[:, None] * sres + k[None, :], mask=mask, other=0.0).to(tl.float32)
        s = cast_rne(x + res, R.dtype.element_ty)  # the sum in its dtype, as the native x + residual
        tl.store(R + r[:, None] * sr + k[None, :], s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + eps)
    xn = cast_rne(x * rstd[:, None], X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + k, mask=k < H, other=0.0).to(tl.float32)
    y = cast_rne(w[None, :] * xn, X.dtype.element_ty).to(tl.float32)  # what the norm kernel stores
    _store_quantized_rows(y, Q, S, r, M, sq, k, mask, FP8_MAX, HW_CVT)


def add_rms_norm_quantize(x2: torch.Tensor, res2: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
    """x2, res2 [M, H] (unit column strides, res2 may be None) -> (e4m3 [M, H], float32 scales [M, 1], x2 + res2 in
    x2's dtype, or x2 itself without a residual)."""
    m, h = x2.shape
    r = torch.empty_like(x2) if res2 is not None else x2
    res = res2 if res2 is not None else x2
    q, s = launch_quantizing(
        _add_rms_norm_quantize_kernel, (x2, res, r, weight), (x2.stride(0), res.stride(0), r.stride(0)), m, h,
        x2.device, TILES, eps=float(eps), HAS_RES=res2 is not None,
    )  # fmt: skip
    return q, s, r


def accepts_add_rms_norm_linear_q(x, residual, weight, eps, qweight, bias=None, options=DEFAULT) -> Optional[str]:
    why = accepts_linear_q(x, qweight, bias)  # the format and the row count first: decode declines here
    if why is not None:
        return why
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return "x and the residual differ in shape or dtype"
    if weight.dtype != x.dtype or weight.shape != x.shape[-1:] or weight.stride(-1) != 1:
        return "the norm weight is not one dense row of x's dtype"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight)):
        return "needs gradients"
    return None


def add_rms_norm_linear_q(x, residual, weight, eps, qweight, bias=None, options=DEFAULT):
    h = x.shape[-1]
    x2 = rows(x, h)
    xq, scale_a, r2 = add_rms_norm_quantize(x2, rows(residual, h) if residual is not None else None, weight, eps)
    return scaled_mm_rows(xq, scale_a, qweight, x, bias, options), (r2.view(x.shape) if residual is not None else x)
