"""Residual add fused with RMSNorm in Triton: ``r = x + residual`` is written once and normalized from registers.

The backward reuses the RMSNorm backward kernel with the gradient flowing into ``r`` added to dx, so x and
residual receive the same gradient (cast to their own dtypes).
"""

import torch

from polyfuse.backends.triton._util import rows
from polyfuse.backends.triton.rms_norm import rms_norm_backward, rms_norm_forward
from polyfuse.core.kernel_options import DEFAULT


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, options):
        h = x.shape[-1]
        if x.shape != residual.shape:
            raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
        shape = x.shape
        y, rstd, r = rms_norm_forward(rows(x, h), weight, eps, residual2=rows(residual, h), options=options)
        ctx.save_for_backward(r, weight, rstd)
        ctx.shape = shape
        ctx.in_dtypes = (x.dtype, residual.dtype)
        return y.view(*shape[:-1], h), r.view(*shape[:-1], h)

    @staticmethod
    def backward(ctx, dy, dr):
        r, weight, rstd = ctx.saved_tensors
        h = r.shape[1]
        if dy is None:
            dy = torch.zeros(ctx.shape, dtype=torch.promote_types(r.dtype, weight.dtype), device=r.device)
        dres2 = rows(dr, h) if dr is not None else None
        d, dw = rms_norm_backward(rows(dy, h), r, weight, rstd, dres2=dres2)
        d = d.view(ctx.shape)
        return d.to(ctx.in_dtypes[0]), d.to(ctx.in_dtypes[1]), dw, None, None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, options=DEFAULT):
    """Returns ``(rms_norm(x + residual), x + residual)``; differentiable in x, residual and weight."""
    return _AddRMSNorm.apply(x, residual, weight, eps, options)
