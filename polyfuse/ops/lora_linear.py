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


def add_lowrank_native(y, h, w, mask=None, scale: float = 1.0) -> None:
    """``y += (h @ w) * mask * scale`` in place (``mask`` None: no mask, no scale): y [T, N] in the layer's dtype,
    h [T, R] and w [R, N] in the adapters' (R a few dozen), mask [T, N] bool. The sum is taken in the adapters'
    dtype and rounded once to y's. The step a backend may replace (backends/triton/lora_linear.py fuses it into one
    pass over y); one whose ``takes_column_views`` is true is given a fused projection's parts one by one as column
    views of y (this one is given them at once, its adds being slow on strided views)."""
    d = h.mm(w)
    if mask is not None:
        d = torch.ops.aten.native_dropout_backward(d, mask, scale)
    y.add_(d)


def _block_diagonal(plan, bs, ranks, n: int) -> torch.Tensor:
    """[sum r, N]: each adapter's B.T in its rank's rows and its output rows' columns, zero elsewhere."""
    w = bs[0].new_zeros((sum(ranks), n))
    row = 0
    for (start, stop, _, _), b, r in zip(plan, bs, ranks):
        w[row : row + r, start:stop] = b.t()
        row += r
    return w


class _LoraLinear(torch.autograd.Function):
    """Per adapter, forward: the dropout mask and hs = (dropped @ A.T) * scaling ([T, r]: scaling folded in); then
    every adapter's hs @ B.T is added to the output by ``add_lowrank``: once per part on its columns where it takes
    column views, else once for all with their B's block-diagonal in one [sum r, N] matrix (one contiguous pass,
    not a strided one per part). Backward: the output
    gradient cast once to the adapters' dtype, each adapter's GEMMs on its columns (views, no copies), the dropped
    input rebuilt by one masked scale of x, each adapter's input gradient added to x's by the low-rank add."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, add_lowrank, *ab):
        out = F.linear(x, weight, bias)
        saved, cast, hs_all = [], {}, []
        for i, (start, stop, scaling, p) in enumerate(plan):
            a = ab[2 * i]
            xa = _cast(cast, x, a.dtype)  # one cast for all the adapters of a fused projection
            dropped, mask = torch.native_dropout(xa, p, True) if p > 0 else (xa, None)
            hs = _flat(dropped).mm(a.t()) * scaling
            hs_all.append(hs)
            saved += [mask, hs]
        bs, out2 = ab[1::2], _flat(out)
        if len(plan) == 1 and plan[0][0] == 0 and plan[0][1] == out.shape[-1]:
            add_lowrank(out2, hs_all[0], bs[0].t())
        elif getattr(add_lowrank, "takes_column_views", False):  # one add per part, on its columns
            for (start, stop, _, _), hs, b in zip(plan, hs_all, bs):
                add_lowrank(out2[:, start:stop], hs, b.t())
        else:
            w = _block_diagonal(plan, bs, [h.shape[-1] for h in hs_all], out.shape[-1])
            add_lowrank(out2, torch.cat(hs_all, dim=-1), w)
        ctx.plan, ctx.add_lowrank = plan, add_lowrank
        ctx.save_for_backward(x, weight, *ab, *saved)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, *rest = ctx.saved_tensors
        n = len(ctx.plan)
        ab, saved = rest[: 2 * n], rest[2 * n :]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad.matmul(weight.to(grad.dtype)) if need_x else None
        grads_ab, cast_x, cast_g = [], {}, {}
        for i, (start, stop, scaling, p) in enumerate(ctx.plan):
            a, b = ab[2 * i], ab[2 * i + 1]
            mask, hs = saved[2 * i], saved[2 * i + 1]
            mask, keep = (None, 1.0) if mask is None else (_flat(mask), 1.0 / (1.0 - p))
            g = _flat(_cast(cast_g, grad, b.dtype))[:, start:stop]  # the cast once per dtype, then a column view
            grad_b = g.t().mm(hs) if ctx.needs_input_grad[5 + 2 * i + 1] else None
            gh = g.mm(b) * scaling  # d loss / d h, [T, r]
            grad_a = None
            if ctx.needs_input_grad[5 + 2 * i]:
                dropped = _flat(_cast(cast_x, x, a.dtype))
                if mask is not None:
                    dropped = torch.ops.aten.native_dropout_backward(dropped, mask, keep)
                grad_a = gh.t().mm(dropped)
                del dropped
            if need_x:  # rounded into x's gradient once per adapter, as autograd sums PEFT's per-adapter gradients
                ctx.add_lowrank(_flat(grad_x), gh, a, mask, keep)
            grads_ab += [grad_a, grad_b]
        grad_w = _flat(grad).t().mm(_flat(x).to(grad.dtype)).to(weight.dtype) if need_w else None
        grad_bias = _flat(grad).sum(0).to(weight.dtype) if need_b else None
        return (grad_x, grad_w, grad_bias, None, None, *grads_ab)


def lora_linear_with(add_lowrank, x, weight, bias, adapters: Sequence[LoraAdapter]) -> torch.Tensor:
    """``lora_linear`` with ``add_lowrank`` (``add_lowrank_native``'s contract) for its low-rank adds."""
    plan = tuple((a.start, a.stop, float(a.scaling), float(a.dropout)) for a in adapters)
    tensors = [t for a in adapters for t in (a.lora_a, a.lora_b)]
    return _LoraLinear.apply(x, weight, bias, plan, add_lowrank, *tensors)


def lora_linear_native(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], adapters: Sequence[LoraAdapter]
) -> torch.Tensor:
    return lora_linear_with(add_lowrank_native, x, weight, bias, adapters)


SPEC = declare(
    OpSpec(
        "lora_linear",
        "lora_linear(x[..., K], weight[N, K], bias[N] | None, adapters) -> x @ weight.T + bias, each adapter's "
        "lora_b(lora_a(dropout(x))) * scaling added to its rows",
        lora_linear_native,
    )
)
