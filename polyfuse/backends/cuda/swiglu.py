"""SwiGLU ``silu(gate) * up`` in Triton, forward and backward, math in fp32 with one rounding.

gate and up may be strided views of one fused [..., 2I] projection: rows may have any stride, the last dim must be
contiguous (it is made so otherwise). The output and the gradients are new contiguous tensors.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.cuda._rounding import cast_rne


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * stride_y + cols, cast_rne(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DU + row * stride_du + cols, cast_rne(dy * silu, DU.dtype.element_ty), mask=mask)
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + row * stride_dg + cols, cast_rne(dg, DG.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _block(i: int) -> int:
    return min(triton.next_power_of_2(max(i, 1)), 1024)


def swiglu_forward(gate, up):
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    i = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    y = torch.empty(g2.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if y.numel():
        block = _block(i)
        grid = (g2.shape[0], triton.cdiv(i, block))
        _swiglu_fwd_kernel[grid](g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), i, BLOCK=block, num_warps=4)
    return y.view(gate.shape)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        y = swiglu_forward(gate, up)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        i = gate.shape[-1]
        g2, u2, dy2 = _rows(gate), _rows(up), _rows(dy)
        dg = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
        du = torch.empty(u2.shape, dtype=up.dtype, device=up.device)
        if dg.numel():
            block = _block(i)
            grid = (g2.shape[0], triton.cdiv(i, block))
            _swiglu_bwd_kernel[grid](
                dy2,
                g2,
                u2,
                dg,
                du,
                dy2.stride(0),
                g2.stride(0),
                u2.stride(0),
                dg.stride(0),
                du.stride(0),
                i,
                BLOCK=block,
                num_warps=4,
            )
        return dg.view(gate.shape), du.view(up.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; differentiable in gate and up."""
    return _SwiGLU.apply(gate, up)
