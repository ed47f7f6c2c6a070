"""RMSNorm: ``y = weight * (x / sqrt(mean(x^2) + eps))``, statistics in fp32, result in x's dtype (HF Llama's rounding)."""

import torch

from polyfuse.core.registry import OpSpec, declare


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 statistics (fp64 stays fp64)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


SPEC = declare(OpSpec("rms_norm", "rms_norm(x[..., H], weight[H], eps) -> y[..., H]", rms_norm_native))
