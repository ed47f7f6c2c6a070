"""Flash-decoding in Triton: attention for Lq == 1 over a KV cache with grouped-query heads (inference only).

Stage 1, grid (B * Hkv, splits): the key length is split into chunks; each program takes the n_rep query heads of
one kv head (a [16+, D] tile, so K/V are read once per group and never repeated), runs an online softmax over its
chunk (fp32 max / sum / weighted values, the additive mask [B, 1, 1, Lk] added to the scaled scores) and writes the
partial results. Stage 2, grid (B * Hq): rescales the partials to a common max and divides by the total sum.
Other shapes (Lq > 1), boolean masks and calls that need gradients go to ``sdpa_attention``.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.cuda._rounding import INTERPRET, cast_rne
from polyfuse.backends.cuda.attention import sdpa_attention
from polyfuse.ops.attention import AttentionMeta


@triton.jit
def _decode_partial_kernel(
    Q,
    K,
    V,
    MASK,
    ACC,
    M_OUT,
    L_OUT,
    Lk,
    HKV,
    N_REP,
    split_len,
    n_splits,
    scale,
    sq_b,
    sq_h,
    sk_b,
    sk_h,
    sk_l,
    sv_b,
    sv_h,
    sv_l,
    sm_b,
    sm_l,
    D: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_bg = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid_bg // HKV
    g = pid_bg % HKV
    r = tl.arange(0, BLOCK_R)
    dd = tl.arange(0, BLOCK_D)
    nn = tl.arange(0, BLOCK_N)
    r_mask = r < N_REP
    d_mask = dd < D
    heads = g * N_REP + r
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + dd[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_R], -1.0e38, tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    k_base = K + b * sk_b + g * sk_h
    v_base = V + b * sv_b + g * sv_h
    start = split * split_len
    end = tl.minimum(start + split_len, Lk)
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + nn
        n_mask = keys < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + keys[:, None] * sk_l + dd[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + keys[:, None] * sv_l + dd[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if HAS_MASK:
            mk = tl.load(MASK + b * sm_b + keys * sm_l, mask=n_mask, other=0.0).to(tl.float32)
            s += mk[None, :]
        s = tl.where(n_mask[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = p
        else:
            pv = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        m_i = m_new
    row = (b * HKV * N_REP + heads) * n_splits + split
    tl.store(M_OUT + row, m_i, mask=r_mask)
    tl.store(L_OUT + row, l_i, mask=r_mask)
    tl.store(ACC + row[:, None] * D + dd[None, :], acc, mask=r_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(
    ACC, M_IN, L_IN, OUT, so_b, so_h, HQ, n_splits, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HQ
    h = pid % HQ
    ss = tl.arange(0, BLOCK_S)
    dd = tl.arange(0, BLOCK_D)
    s_mask = ss < n_splits
    d_mask = dd < D
    rows = pid * n_splits + ss
    m = tl.load(M_IN + rows, mask=s_mask, other=-float("inf"))
    l = tl.load(L_IN + rows, mask=s_mask, other=0.0)
    acc = tl.load(ACC + rows[:, None] * D + dd[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(s_mask, tl.exp(m - m_max), 0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(OUT + b * so_b + h * so_h + dd, cast_rne(out, OUT.dtype.element_ty), mask=d_mask)


def _n_splits(device: torch.device, b: int, hkv: int, lk: int, block_n: int):
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    blocks = -(-lk // block_n)
    n_splits = max(1, min(blocks, -(-4 * sms // (b * hkv)), 128))
    split_len = -(-blocks // n_splits) * block_n
    return -(-lk // split_len), split_len


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    """Flash-decoding for Lq == 1 (inference); anything else goes to ``sdpa_attention``."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    mask = meta.mask
    if lq != 1 or needs_grad or lk == 0 or (mask is not None and (mask.shape[-2] != 1 or mask.dtype == torch.bool)):
        return sdpa_attention(q, k, v, meta)
    n_rep = hq // hkv
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_n = 64 if d <= 128 else 32
    n_splits, split_len = _n_splits(q.device, b, hkv, lk, block_n)
    acc = torch.empty((b * hq * n_splits, d), dtype=torch.float32, device=q.device)
    m = torch.empty((b * hq * n_splits,), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    if mask is not None:
        mask = mask.expand(b, 1, 1, lk)
    out = torch.empty((b, hq, 1, d), dtype=q.dtype, device=q.device)
    upcast = INTERPRET or q.dtype == torch.float32
    _decode_partial_kernel[(b * hkv, n_splits)](
        q,
        k,
        v,
        mask if mask is not None else q,
        acc,
        m,
        l,
        lk,
        hkv,
        n_rep,
        split_len,
        n_splits,
        float(meta.scale),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        mask.stride(0) if mask is not None else 0,
        mask.stride(3) if mask is not None else 0,
        D=d,
        HAS_MASK=mask is not None,
        BLOCK_R=max(16, triton.next_power_of_2(n_rep)),
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        UPCAST=upcast,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    _decode_reduce_kernel[(b * hq,)](
        acc,
        m,
        l,
        out,
        out.stride(0),
        out.stride(1),
        hq,
        n_splits,
        D=d,
        BLOCK_S=triton.next_power_of_2(n_splits),
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=4,
    )
    return out
