"""Rotary position embedding (rotate-half layout) on q and k in one Triton launch.

Grid: (B * L, head blocks of q + head blocks of k). Each program reads the fp32 cos/sin row of its (b, l) once,
rotates a block of heads in fp32 and rounds once to q/k's dtype (the native bf16 path rounds cos/sin to bf16 first
and rounds after each product and the sum, so this is at least as accurate).

q [B, Hq, L, D] and k [B, Hkv, L, D] may be strided views (e.g. of a fused QKV projection): any strides for B, H,
L, unit stride for D. The backward is the inverse rotation (sin negated); cos/sin get no gradient.

Where q and k are intermediate results of a differentiable computation (a projection's output, as in a decoder),
the rotation is written over them and they are returned, as Liger-Kernel's RoPE does: each element is read before it
is written, and the projection that made them keeps its input, not its output, for its backward. That keeps no
second [B, H, L, D] copy of q and k alive while attention holds them (0.08 GiB per layer at the 1B shape's 8 x 2048
tokens, at the training step's memory peak). Anything else (a caller's own tensors, inference without autograd)
gets new tensors (``torch.empty_like``: the input layout when it is dense, contiguous otherwise).
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import cast_rne


@triton.jit
def _rotate_block(IN, OUT, s_h, o_h, heads, n_heads, d, d_mask, c1, c2, s1, s2, HALF: tl.constexpr, BACKWARD):
    mask = (heads < n_heads)[:, None] & d_mask[None, :]
    in_offs = heads[:, None] * s_h + d[None, :]
    out_offs = heads[:, None] * o_h + d[None, :]
    x1 = tl.load(IN + in_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(IN + in_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(OUT + out_offs, cast_rne(y1, OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + out_offs + HALF, cast_rne(y2, OUT.dtype.element_ty), mask=mask)


@triton.jit
def _load_cos_sin(cos_row, sin_row, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The fp32 cos/sin halves of one (b, l) row, as [1, BLOCK_HALF] tiles, with the head-dim offsets and mask."""
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    c1 = tl.load(cos_row + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return d, d_mask, c1, c2, s1, s2


@triton.jit
def _rotary_kernel(
    Q,
    K,
    QO,
    KO,
    COS,
    SIN,
    L,
    HQ,
    HKV,
    sq_b,
    sq_h,
    sq_l,
    sk_b,
    sk_h,
    sk_l,
    oq_b,
    oq_h,
    oq_l,
    ok_b,
    ok_h,
    ok_l,
    sc_b,
    sc_l,
    ss_b,
    ss_l,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    pid_bl = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    b = pid_bl // L
    l = pid_bl % L
    d, d_mask, c1, c2, s1, s2 = _load_cos_sin(COS + b * sc_b + l * sc_l, SIN + b * ss_b + l * ss_l, HALF, BLOCK_HALF)
    n_q_blocks = tl.cdiv(HQ, BLOCK_H)
    if pid_h < n_q_blocks:
        heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_block(
            Q + b * sq_b + l * sq_l,
            QO + b * oq_b + l * oq_l,
            sq_h,
            oq_h,
            heads,
            HQ,
            d,
            d_mask,
            c1,
            c2,
            s1,
            s2,
            HALF,
            BACKWARD,
        )
    else:
        heads = (pid_h - n_q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_block(
            K + b * sk_b + l * sk_l,
            KO + b * ok_b + l * ok_l,
            sk_h,
            ok_h,
            heads,
            HKV,
            d,
            d_mask,
            c1,
            c2,
            s1,
            s2,
            HALF,
            BACKWARD,
        )


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _cos_sin(t: torch.Tensor, b: int, length: int, d: int) -> torch.Tensor:
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() == 4:  # [B, 1, L, D] as some callers pre-unsqueeze
        t = t.squeeze(1)
    return _unit_last(t.expand(b, length, d))


def rotary_apply(q, k, cos, sin, backward: bool = False, in_place: bool = False):
    b, hq, length, d = q.shape
    hkv = k.shape[1]
    if d % 2:
        raise ValueError(f"rotary: head dim {d} must be even")
    if k.shape[0] != b or k.shape[2] != length or k.shape[3] != d:
        raise ValueError(f"rotary: q {tuple(q.shape)} and k {tuple(k.shape)} do not match")
    q, k = _unit_last(q), _unit_last(k)
    cos, sin = _cos_sin(cos, b, length, d), _cos_sin(sin, b, length, d)
    qo, ko = (q, k) if in_place else (torch.empty_like(q), torch.empty_like(k))
    if q.numel() == 0:
        return qo, ko
    half = d // 2
    block_h = min(triton.next_power_of_2(max(hq, hkv)), 16)
    grid = (b * length, triton.cdiv(hq, block_h) + triton.cdiv(hkv, block_h))
    _rotary_kernel[grid](
        q,
        k,
        qo,
        ko,
        cos,
        sin,
        length,
        hq,
        hkv,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        qo.stride(0),
        qo.stride(1),
        qo.stride(2),
        ko.stride(0),
        ko.stride(1),
        ko.stride(2),
        cos.stride(0),
        cos.stride(1),
        sin.stride(0),
        sin.stride(1),
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=block_h,
        BACKWARD=backward,
        num_warps=4,
    )
    return qo, ko


def _overwritable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the forward may rotate q and k where they are (module docstring): both intermediate results of a
    differentiable computation, unit stride in D, and not the same memory."""
    if q.is_leaf or k.is_leaf or q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    return q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr() or _disjoint(q, k)


def _disjoint(q: torch.Tensor, k: torch.Tensor) -> bool:
    """q, k [B, H, L, D] as views of one [B, L, width] projection (the fused QKV): disjoint when they step through
    rows alike and their column ranges inside a row do not meet. Anything else counts as overlapping."""
    if q.dim() != 4 or q.stride(0) != k.stride(0) or q.stride(2) != k.stride(2):
        return False

    def columns(t):
        start = t.storage_offset()
        return start, start + (t.shape[1] - 1) * t.stride(1) + t.shape[3]

    (a0, a1), (b0, b1) = columns(q), columns(k)
    return (a1 <= b0 or b1 <= a0) and max(a1, b1) - min(a0, b0) <= q.stride(2)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        qo, ko = rotary_apply(q, k, cos, sin, in_place=_overwritable(q, k))
        ctx.save_for_backward(cos, sin)
        return qo, ko

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = rotary_apply(dq, dk, cos, sin, backward=True)
        return dq_in, dk_in, None, None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Returns ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` as new tensors."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _Rotary.apply(q, k, cos, sin)
    return rotary_apply(q, k, cos, sin)
