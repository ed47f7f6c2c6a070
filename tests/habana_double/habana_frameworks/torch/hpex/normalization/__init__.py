"""TEST DOUBLE of ``habana_frameworks.torch.hpex.normalization``: FusedRMSNorm and FusedClipNorm (CPU math)."""

import torch

from habana_frameworks import on_hpu, record


class FusedRMSNorm:
    """``apply(x, weight, eps)``; x and weight must share a dtype (optimum-habana casts x before calling)."""

    @staticmethod
    def apply(*args, **kwargs):
        if kwargs or len(args) != 3:
            raise ValueError("FusedRMSNorm (test double): expects (x, weight, eps)")
        record("FusedRMSNorm", *args)
        x, weight, eps = args
        on_hpu("FusedRMSNorm", x, weight)
        if x.dtype != weight.dtype:
            raise TypeError(f"FusedRMSNorm (test double): x {x.dtype} and weight {weight.dtype} dtypes differ")
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(f"FusedRMSNorm (test double): weight {tuple(weight.shape)} vs x {tuple(x.shape)}")
        if not isinstance(eps, float):
            raise TypeError(f"FusedRMSNorm (test double): eps must be a float, got {eps!r}")
        xf = x.float()
        return (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class FusedClipNorm:
    """``FusedClipNorm(parameters, max_norm)``; ``clip_norm(parameters)`` clips grads in place, returns the norm."""

    def __init__(self, parameters, max_norm):
        self.max_norm = float(max_norm)
        record("FusedClipNorm", max_norm=self.max_norm)

    def clip_norm(self, parameters):
        grads = [p.grad for p in parameters if p.grad is not None]
        on_hpu("FusedClipNorm", *grads)
        record("FusedClipNorm.clip_norm", len(grads))
        if not grads:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total
