"""``lora_linear``: a frozen linear layer with LoRA adapters on row ranges of its output, as PEFT computes them.

``lora_linear(x, weight, bias, adapters)`` is ``F.linear(x, weight, bias)`` with, for each ``LoraAdapter`` on rows
``[start, stop)``, PEFT's plain LoRA added: ``lora_b(lora_a(dropout(x))) * scaling`` in the adapters' dtype (PEFT
keeps bf16 models' adapters in fp32), the sum cast back to the output's dtype. One call can carry several adapters
on one fused weight (polyfuse's ``qkv_proj`` with LoRA on q and v): the base GEMM runs once instead of per part.

The native reference is one autograd node that keeps less than PEFT's modules do: ``x`` once in its own dtype and
one bool dropout mask per adapter, not the adapter-dtype copy of ``x`` that each dropout output is (4 bytes per
input element per adapter for a bf16 model); the dropped input is rebuilt from ``x`` and the mask in the backward.
The mask comes from ``torch.native_dropout``, what ``F.dropout`` runs on CPU and CUDA, so the same seed drops the
same elements as PEFT's module in the same order. Gradients: ``x``, each adapter's A and B, and the base weight and
bias only if they require one (PEFT freezes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from polyfuse.core.registry import OpSpec, declare


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter on output rows ``[start, stop)``: ``lora_a`` [r, K], ``lora_b`` [stop - start, r], the output
    scaled by ``scaling``, the input dropped with probability ``dropout`` (0: no dropout)."""

    start: int
    stop: int
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    dropout: float = 0.0


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _cast(cache: dict, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype not in cache:
        cache[dtype] = x.to(dtype)
    return cache[dtype]


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan, *ab):
        out = F.linear(x, weight, bias)
        saved, cast = [], {}
        for i, (start, stop, scaling, p) in enumerate(plan):
            a, b = ab[2 * i], ab[2 * i + 1]
            xa = _cast(cast, x, a.dtype)  # one cast for all the adapters of a fused projection
            dropped, mask = torch.native_dropout(xa, p, True) if p > 0 else (xa, None)
            h = F.linear(dropped, a)
            # PEFT: result + lora_B(lora_A(dropout(x))) * scaling, promoted to the adapter dtype, then cast back
            out[..., start:stop] = out[..., start:stop] + F.linear(h, b) * scaling
            saved += [mask, h]
        ctx.plan = plan
        ctx.save_for_backward(x, weight, *ab, *saved)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, *rest = ctx.saved_tensors
        n = len(ctx.plan)
        ab, saved = rest[: 2 * n], rest[2 * n :]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad.matmul(weight.to(grad.dtype)) if need_x else None
        grads_ab, cast = [], {}
        for i, (start, stop, scaling, p) in enumerate(ctx.plan):
            a, b = ab[2 * i], ab[2 * i + 1]
            mask, h = saved[2 * i], saved[2 * i + 1]
            g = grad[..., start:stop].to(b.dtype) * scaling
            grad_b = _flat(g).t().mm(_flat(h)) if ctx.needs_input_grad[4 + 2 * i + 1] else None
            gh = g.matmul(b)
            dropped = _cast(cast, x, a.dtype)
            if mask is not None:
                dropped = dropped * mask * (1.0 / (1.0 - p))
            grad_a = _flat(gh).t().mm(_flat(dropped)) if ctx.needs_input_grad[4 + 2 * i] else None
            if need_x:
                gd = gh.matmul(a)
                if mask is not None:
                    gd = gd * mask * (1.0 / (1.0 - p))
                grad_x = grad_x + gd.to(grad_x.dtype)
            grads_ab += [grad_a, grad_b]
        grad_w = _flat(grad).t().mm(_flat(x).to(grad.dtype)).to(weight.dtype) if need_w else None
        grad_bias = _flat(grad).sum(0).to(weight.dtype) if need_b else None
        return (grad_x, grad_w, grad_bias, None, *grads_ab)


def lora_linear_native(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], adapters: Sequence[LoraAdapter]
) -> torch.Tensor:
    plan = tuple((a.start, a.stop, float(a.scaling), float(a.dropout)) for a in adapters)
    tensors = [t for a in adapters for t in (a.lora_a, a.lora_b)]
    return _LoraLinear.apply(x, weight, bias, plan, *tensors)


SPEC = declare(
    OpSpec(
        "lora_linear",
        "lora_linear(x[..., K], weight[N, K], bias[N] | None, adapters) -> x @ weight.T + bias, each adapter's "
        "lora_b(lora_a(dropout(x))) * scaling added to its rows",
        lora_linear_native,
    )
)
