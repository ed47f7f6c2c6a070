"""SwiGLU ``silu(gate) * up`` in Triton, forward and backward, math in fp32 with one rounding.

gate and up may be strided views of one fused [..., 2I] projection: rows may have any stride, the last dim must be
contiguous (it is made so otherwise). The output is a new contiguous tensor. When gate and up are the two halves of
one contiguous tensor that needs a gradient, the autograd node takes that tensor itself and the backward writes its
gradient whole: autograd would otherwise build it from the two halves' gradients (two zero-filled [..., 2I] buffers,
two copies and an add per layer).

The backward writes the gradients over the saved gate and up (each element is read before it is written), as
Liger-Kernel's SwiGLU does: no new [..., 2I] buffer at the training step's memory peak (the MLP backward of the
checkpointed layer; 0.5 GiB for the 1B shape at 8 x 2048 tokens). So gate and up must not be kept by another op for
its own backward — in a decoder MLP they are the gate/up projection's output, which its GEMM does not keep. Leaf
tensors (a caller's own) are never overwritten.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import launch_then_wait, pdl_options, wait_prior
from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.backends.triton._util import rows
from polyfuse.core.kernel_options import DEFAULT


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, I, BLOCK: tl.constexpr, PDL: tl.constexpr,
                       EARLY: tl.constexpr = False):  # fmt: skip
    if EARLY:  # the next kernel launches before this one waits (_pdl.launch_then_wait)
        launch_then_wait(PDL)
    else:
        wait_prior(PDL)
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


def _block(i: int) -> int:
    return min(triton.next_power_of_2(max(i, 1)), 1024)


def swiglu_forward(gate, up, early=False, options=DEFAULT):
    """silu(gate) * up by the forward kernel (no autograd node); ``early``: the next kernel may launch before this
    one waits (_pdl.launch_then_wait)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    i = gate.shape[-1]
    g2, u2 = rows(gate), rows(up)
    y = torch.empty(g2.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if y.numel():
        block = _block(i)
        grid = (g2.shape[0], triton.cdiv(i, block))
        _swiglu_fwd_kernel[grid](
            g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), i, BLOCK=block, EARLY=early, num_warps=4,
            **pdl_options(y.device, options),
        )  # fmt: skip
    return y.view(gate.shape)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, options):
        y = swiglu_forward(gate, up, options=options)
        ctx.save_for_backward(gate, up)
        ctx.overwrite = not (gate.is_leaf or up.is_leaf)  # never a caller's own tensors
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        if ctx.overwrite and _writable(gate, up):  # the gradients go over gate and up (module docstring)
            dg, du = gate, up
        else:
            dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
            du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        _backward_into(dy, gate, up, dg, du)
        return dg, du, None


class _SwiGLUHalves(torch.autograd.Function):
    """silu(x[..., :I]) * x[..., I:] with x's gradient written in one buffer."""

    @staticmethod
    def forward(ctx, x):
        i = x.shape[-1] // 2
        ctx.save_for_backward(x)
        ctx.overwrite = not x.is_leaf  # never a caller's own tensor
        return swiglu_forward(x[..., :i], x[..., i:])

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        i = x.shape[-1] // 2
        dx = x if ctx.overwrite else torch.empty_like(x)  # over the saved input (module docstring)
        _backward_into(dy, x[..., :i], x[..., i:], dx[..., :i], dx[..., i:])
        return dx


def _writable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the backward may write d(gate), d(up) over gate and up: last dims contiguous (the kernel's layout)
    and the two disjoint (swiglu(x, x) must not get both gradients written into one buffer)."""
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        return False
    if gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr():
        return True
    # One storage (the halves of a [..., 2I] projection): disjoint when, with equal strides, up's columns start at
    # least I elements after or before gate's and still fit inside the row.
    i, d = gate.shape[-1], abs(up.storage_offset() - gate.storage_offset())
    row = gate.stride(-2) if gate.dim() > 1 else float("inf")
    return gate.stride() == up.stride() and d >= i and d + i <= row


def _backward_into(dy, gate, up, dg, du) -> None:
    """Write d(gate) and d(up) into ``dg`` / ``du`` (row-strided views with a contiguous last dim)."""
    i = gate.shape[-1]
    g2, u2, dy2 = rows(gate), rows(up), rows(dy)
    dg, du = dg.view(-1, i), du.view(-1, i)  # views (never copies): the kernel writes the caller's memory
    if not dg.numel():
        return
    block = _block(i)
    grid = (g2.shape[0], triton.cdiv(i, block))
    _swiglu_bwd_kernel[grid](
        dy2, g2, u2, dg, du, dy2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0), du.stride(0), i,
        BLOCK=block, num_warps=4,
    )  # fmt: skip


def _fused_source(gate: torch.Tensor, up: torch.Tensor):
    """The [..., 2I] tensor whose halves are gate and up, when there is one (contiguous, needing a gradient)."""
    base, i = gate._base, gate.shape[-1]
    if base is None or up._base is not base or not base.requires_grad or not base.is_contiguous():
        return None
    if base.numel() != 2 * gate.numel():
        return None
    x = base.view(*gate.shape[:-1], 2 * i)
    halves = x[..., :i], x[..., i:]
    if any(h.data_ptr() != t.data_ptr() or h.stride() != t.stride() for h, t in zip(halves, (gate, up))):
        return None
    return x


def swiglu(gate: torch.Tensor, up: torch.Tensor, options=DEFAULT) -> torch.Tensor:
    """``silu(gate) * up``; differentiable in gate and up."""
    if torch.is_grad_enabled() and gate.shape == up.shape and gate.dim() > 1:
        x = _fused_source(gate, up)
        if x is not None:  # training (gradients on): no PDL launch to configure
            return _SwiGLUHalves.apply(x)
    return _SwiGLU.apply(gate, up, options)
