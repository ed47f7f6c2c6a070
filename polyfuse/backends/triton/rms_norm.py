"""RMSNorm in Triton: one row per program, fp32 statistics, the native rounding (normalize in fp32, round to x's
dtype, then multiply by the weight). The forward stores 1/rms per row for the backward; the backward writes dx and
per-program partial sums of dweight (fp32) that are reduced with one torch sum.

The kernels are shared with ``add_rms_norm`` (residual add fused in front, residual gradient added in the backward).
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import launch_then_wait, pdl_options, wait_prior
from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.backends.triton._util import rows, sm_count
from polyfuse.core.kernel_options import DEFAULT


MAX_BLOCK = 65536


@triton.jit
def _rms_norm_fwd_kernel(
    X,
    RES,
    R,
    W,
    Y,
    RSTD,
    stride_x,
    stride_res,
    stride_r,
    stride_y,
    H,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr = False,
):
    if EARLY:  # the next kernel launches before this one waits (_pdl.launch_then_wait)
        launch_then_wait(PDL)
    else:
        wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(RES + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # The summed residual is rounded to its dtype (as the native ``x + residual``) before the statistics.
        r = cast_rne(x + res, R.dtype.element_ty)
        tl.store(R + row * stride_r + cols, r, mask=mask)
        x = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(RSTD + row, rstd)
    if HAS_RES:
        xn = cast_rne(x * rstd, R.dtype.element_ty).to(tl.float32)
    else:
        xn = cast_rne(x * rstd, X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, cast_rne(w * xn, Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY,
    X,
    W,
    RSTD,
    DRES,
    DX,
    DW_PART,
    stride_dy,
    stride_x,
    stride_dres,
    stride_dx,
    N,
    H,
    rows_per_program,
    HAS_DRES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < H
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, N)
    for row in range(row_start, row_end):
        mask = col_mask
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        # dweight sees the normalized value rounded like the forward.
        dw_acc += dy * cast_rne(xhat, X.dtype.element_ty).to(tl.float32)
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / H))
        if HAS_DRES:
            dx += tl.load(DRES + row * stride_dres + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, cast_rne(dx, DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid.to(tl.int64) * H + cols, dw_acc, mask=col_mask)


def _launch_params(h: int):
    block = triton.next_power_of_2(h)
    if block > MAX_BLOCK:
        raise ValueError(f"rms_norm: hidden size {h} is larger than the kernel's {MAX_BLOCK} limit")
    num_warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    return block, num_warps


def _n_programs(device: torch.device, n_rows: int) -> int:
    return max(1, min(n_rows, 4 * sm_count(device) if device.type == "cuda" else 4))


def rms_norm_forward(x2, weight, eps, residual2=None, early=False, options=DEFAULT):
    """x2 [N, H] (unit column stride). Returns (y, rstd, r) where r is the summed residual (or x2 itself). ``early``:
    the next kernel may launch before this one waits for the one before (_pdl.launch_then_wait)."""
    n, h = x2.shape
    block, num_warps = _launch_params(h)
    if residual2 is not None:
        r = torch.empty((n, h), dtype=torch.promote_types(x2.dtype, residual2.dtype), device=x2.device)
    else:
        r = x2
    y = torch.empty((n, h), dtype=torch.promote_types(r.dtype, weight.dtype), device=x2.device)
    rstd = torch.empty((n,), dtype=torch.float32, device=x2.device)
    if n > 0:
        res = residual2 if residual2 is not None else x2
        _rms_norm_fwd_kernel[(n,)](
            x2,
            res,
            r,
            weight,
            y,
            rstd,
            x2.stride(0),
            res.stride(0),
            r.stride(0),
            y.stride(0),
            h,
            float(eps),
            HAS_RES=residual2 is not None,
            BLOCK=block,
            EARLY=early,
            num_warps=num_warps,
            **pdl_options(x2.device, options),
        )
    return y, rstd, r


def rms_norm_backward(dy2, x2, weight, rstd, dres2=None, dx_dtype=None):
    """Returns (dx [N, H], dweight [H]) for the normalized input x2; dres2 is added to dx when given."""
    n, h = x2.shape
    block, num_warps = _launch_params(h)
    dx = torch.empty((n, h), dtype=dx_dtype or x2.dtype, device=x2.device)
    programs = _n_programs(x2.device, n)
    rows_per_program = triton.cdiv(n, programs) if n else 0
    dw_part = torch.zeros((programs, h), dtype=torch.float32, device=x2.device)
    if n > 0:
        dres = dres2 if dres2 is not None else dy2
        _rms_norm_bwd_kernel[(programs,)](
            dy2,
            x2,
            weight,
            rstd,
            dres,
            dx,
            dw_part,
            dy2.stride(0),
            x2.stride(0),
            dres.stride(0),
            dx.stride(0),
            n,
            h,
            rows_per_program,
            HAS_DRES=dres2 is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    return dx, dw_part.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, options):
        h = x.shape[-1]
        x2 = rows(x, h)
        y, rstd, _ = rms_norm_forward(x2, weight, eps, options=options)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], h)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dy2 = rows(dy, x2.shape[1])
        dx, dw = rms_norm_backward(dy2, x2, weight, rstd)
        return dx.view(ctx.x_shape), dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, options=DEFAULT) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` with the native op's rounding; differentiable in x and weight."""
    return _RMSNorm.apply(x, weight, eps, options)
