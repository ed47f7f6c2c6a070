"""Training's MLP down projection with its SwiGLU folded in: ``F.linear(silu(gate) * up, weight, bias)`` whose
backward recomputes ``silu(gate) * up`` instead of keeping it.

The composite (swiglu, then linear) keeps the [tokens, I] product for the weight gradient, so the down projection's
backward holds gate/up, that product and its gradient at once: the training step's memory peak with activation
checkpointing (issue 13: +0.25 GiB for the 1B shape at 8 x 2048 tokens). Here the backward recomputes the product
(one elementwise Triton pass), takes the weight gradient, frees it, and only then forms its gradient, whose SwiGLU
backward writes over gate/up (as the Triton SwiGLU does). Training only: inference takes the GEMV or the composite.

Opt-in (``swiglu_linear=triton_recompute``; backends/triton/register.py): measured on the H200 (Llama-3.2-1B shape,
8 x 2048 tokens, checkpointing) it lowers the step's peak from 10.67 to 10.45 GiB but costs 5% of the speed
(56.0k against 59.0k tokens/s), so the composite stays the default.
"""

import torch

from polyfuse.backends.triton.swiglu import _backward_into, _fused_source, _writable, swiglu_forward


class _SwiGLULinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, i, weight, bias):
        """x: [..., 2I], gate = x[..., :I], up = x[..., I:] (one buffer: its gradient is written whole)."""
        gate, up = x[..., :i], x[..., i:]
        out = torch.nn.functional.linear(swiglu_forward(gate, up), weight, bias)  # the product dies here
        ctx.save_for_backward(x, weight)
        ctx.i, ctx.has_bias = i, bias is not None
        ctx.overwrite = not x.is_leaf  # never a caller's own tensor
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        i = ctx.i
        gate, up = x[..., :i], x[..., i:]
        d2 = dout.reshape(-1, dout.shape[-1])
        dw = db = None
        if ctx.needs_input_grad[2]:
            y = swiglu_forward(gate, up)
            dw = d2.t().mm(y.reshape(-1, i)).to(weight.dtype)
            del y  # freed before its gradient exists
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = d2.sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dy = dout.matmul(weight.to(dout.dtype))
            dx = x if (ctx.overwrite and _writable(gate, up)) else torch.empty_like(x)
            _backward_into(dy, gate, up, dx[..., :i], dx[..., i:])
        return dx, None, dw, db


class _SwiGLULinearPair(torch.autograd.Function):
    """The same for gate and up that are not the halves of one buffer (two projections)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        out = torch.nn.functional.linear(swiglu_forward(gate, up), weight, bias)
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        ctx.overwrite = not (gate.is_leaf or up.is_leaf)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up, weight = ctx.saved_tensors
        i = gate.shape[-1]
        d2 = dout.reshape(-1, dout.shape[-1])
        dw = db = dg = du = None
        if ctx.needs_input_grad[2]:
            y = swiglu_forward(gate, up)
            dw = d2.t().mm(y.reshape(-1, i)).to(weight.dtype)
            del y
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = d2.sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dy = dout.matmul(weight.to(dout.dtype))
            if ctx.overwrite and _writable(gate, up):
                dg, du = gate, up
            else:
                dg, du = torch.empty_like(gate), torch.empty_like(up)
            _backward_into(dy, gate, up, dg, du)
        return dg, du, dw, db


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight, bias)``, differentiable in all four, keeping no [..., I] product."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu_linear: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if gate.dim() > 1 and gate.stride(-1) == 1 and up.stride(-1) == 1:
        x = _fused_source(gate, up)
        if x is not None:
            return _SwiGLULinear.apply(x, gate.shape[-1], weight, bias)
    gate, up = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, up))
    return _SwiGLULinearPair.apply(gate, up, weight, bias)
