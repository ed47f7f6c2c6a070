"""Residual add fused with RMSNorm: ``r = x + residual; return rms_norm(r), r``."""

import torch

from polyfuse.core.registry import OpSpec, declare
from polyfuse.ops.rms_norm import rms_norm_native


def add_rms_norm_native(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    r = x + residual
    return rms_norm_native(r, weight, eps), r


SPEC = declare(
    OpSpec(
        "add_rms_norm",
        "add_rms_norm(x[..., H], residual[..., H], weight[H], eps) -> (y, x + residual)",
        add_rms_norm_native,
    )
)
