"""RMSNorm on Gaudi: ``habana_frameworks.torch.hpex.normalization.FusedRMSNorm.apply(x, weight, eps)``.

As optimum-habana's ``gaudi_llama_rmsnorm_forward`` does, x is cast to the weight's dtype for the kernel when the
two differ, and the result is cast back to x's dtype.
"""

from __future__ import annotations

import torch

from polyfuse.backends.hpu import _habana


def _kernel():
    return _habana.require(_habana.NORMALIZATION, "FusedRMSNorm")


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    kernel = _kernel()
    if x.dtype != weight.dtype:
        return kernel.apply(x.to(weight.dtype), weight, eps).to(x.dtype)
    return kernel.apply(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add (a plain op: Habana has no fused add+norm kernel), then FusedRMSNorm."""
    r = x + residual
    return fused_rms_norm(r, weight, eps), r
