"""Flash-decoding in Triton: attention for Lq == 1 over a KV cache with grouped-query heads (inference only).

One launch, grid (B * Hkv, splits): the key length is split into chunks; each program takes the n_rep query heads
of one kv head (a [16+, D] tile, so K/V are read once per group and never repeated) and runs an online softmax
over its chunk (fp32 max / sum / weighted values). Keys are masked either by the additive mask [B, 1, 1, Lk] or,
when the model passes them (``meta.key_mask`` + ``meta.cache_position``), straight from the boolean key mask and
the query's cache slot, so no mask tensor is built per step. With one split the program writes the output; with
several it writes its partial results, and the last program of its group to finish (an atomic counter per group,
reset by that program) rescales the partials to a common max and writes the output: no second launch.
A sliding window (``meta.window``) masks keys at or before ``slot - window`` the same way. With the key mask and
slot, keys past the slot are not read and the splits wholly past it store nothing (a CUDA graph is captured for the
cache's length and replayed at every slot, so a long cache early in a generation costs little more than a short one).
From LONG keys on, programs take blocks of 128 keys at two programs per multiprocessor (LONG_TILE). Other shapes
(Lq > 1), boolean masks and calls that need gradients are declined (``accepts``): the registry's next choice takes
them.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._online_softmax import online_softmax_step
from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._rounding import INTERPRET, cast_rne
from polyfuse.backends.triton._util import sm_count
from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.attention import AttentionMeta


@triton.jit
def _decode_kernel(
    Q, K, V, MASK, KEY_MASK, CACHE_POS, ACC, M_OUT, L_OUT, COUNTERS, OUT,
    Lk, HKV, N_REP, split_len, n_splits, scale, window,
    sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_l, skm_b, so_b, so_h,
    D: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, RED_R: tl.constexpr, RED_S: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """MASK_KIND 0: none, 1: additive MASK [B, 1, 1, Lk], 2: boolean KEY_MASK [B, Lk] and keys <= CACHE_POS[0]
    (and keys > CACHE_POS[0] - window when WINDOWED)."""
    wait_prior(PDL)
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
    n_live = n_splits
    if MASK_KIND == 2:
        last_key = tl.load(CACHE_POS).to(tl.int64)
        # keys past the query's slot are masked: their blocks are not read at all (a graph captured for a KV length
        # replays at every slot up to it), and the splits wholly past the slot store nothing: the combine reads the
        # n_live splits that hold a key at or before it
        end = tl.minimum(end, last_key + 1)
        n_live = tl.minimum(n_splits, (last_key + split_len) // split_len)
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
        valid = n_mask
        if MASK_KIND == 1:
            mk = tl.load(MASK + b * sm_b + keys * sm_l, mask=n_mask, other=0.0).to(tl.float32)
            s += mk[None, :]
        if MASK_KIND == 2:
            real = tl.load(KEY_MASK + b * skm_b + keys, mask=n_mask, other=0)
            valid = valid & (real != 0) & (keys <= last_key)
            if WINDOWED:
                valid = valid & (keys > last_key - window)
        s = tl.where(valid[None, :], s, -float("inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, UPCAST, PRECISION)
    out_mask = r_mask[:, None] & d_mask[None, :]
    out_ptr = OUT + b * so_b + heads[:, None] * so_h + dd[None, :]
    if n_splits == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr, cast_rne(out, OUT.dtype.element_ty), mask=out_mask)
    else:
        row = (b * HKV * N_REP + heads) * n_splits + split
        live = r_mask & (r * 0 + split < n_live)
        tl.store(M_OUT + row, m_i, mask=live)
        tl.store(L_OUT + row, l_i, mask=live)
        tl.store(ACC + row[:, None] * D + dd[None, :], acc, mask=live[:, None] & d_mask[None, :])
        tl.debug_barrier()  # every thread's partial stores precede the release below
        done = tl.atomic_add(COUNTERS + pid_bg, 1, sem="acq_rel", scope="gpu")
        if done == n_splits - 1:  # the group's last program: combine the live partials
            _combine(ACC, M_OUT, L_OUT, OUT, b, g, HKV, N_REP, n_splits, n_live, so_b, so_h, D, BLOCK_D, RED_R,
                     RED_S)  # fmt: skip
            tl.atomic_xchg(COUNTERS + pid_bg, 0, sem="relaxed", scope="gpu")


@triton.jit
def _combine(ACC, M_IN, L_IN, OUT, b, g, HKV, N_REP, n_splits, n_live, so_b, so_h, D: tl.constexpr,
             BLOCK_D: tl.constexpr, RED_R: tl.constexpr, RED_S: tl.constexpr):  # fmt: skip
    """Rescale the first n_live of the n_splits partials of the group's heads to a common max, sum, normalize,
    store."""
    r = tl.arange(0, RED_R)
    ss = tl.arange(0, RED_S)
    dd = tl.arange(0, BLOCK_D)
    r_mask = r < N_REP
    d_mask = dd < D
    base = (b * HKV * N_REP + g * N_REP + r) * n_splits  # [RED_R]
    m_run = tl.full([RED_R], -1.0e38, tl.float32)
    l_run = tl.zeros([RED_R], dtype=tl.float32)
    acc_run = tl.zeros([RED_R, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_live, RED_S):
        s_mask = (s0 + ss) < n_live
        rs_mask = r_mask[:, None] & s_mask[None, :]
        rows = base[:, None] + s0 + ss[None, :]  # [RED_R, RED_S]
        m = tl.load(M_IN + rows, mask=rs_mask, other=-1.0e38, cache_modifier=".cg")
        l = tl.load(L_IN + rows, mask=rs_mask, other=0.0, cache_modifier=".cg")
        a = tl.load(
            ACC + rows[:, :, None] * D + dd[None, None, :],
            mask=rs_mask[:, :, None] & d_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_run, tl.max(m, axis=1))
        w = tl.where(rs_mask, tl.exp(m - m_new[:, None]), 0.0)
        alpha = tl.exp(m_run - m_new)
        l_run = l_run * alpha + tl.sum(l * w, axis=1)
        acc_run = acc_run * alpha[:, None] + tl.sum(a * w[:, :, None], axis=1)
        m_run = m_new
    out = acc_run / tl.where(l_run > 0, l_run, 1.0)[:, None]
    heads = g * N_REP + r
    tl.store(
        OUT + b * so_b + heads[:, None] * so_h + dd[None, :],
        cast_rne(out, OUT.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
    )


# (keys per block, warps, software-pipelining stages) of a program for KV lengths below LONG and from LONG on, and the
# programs per multiprocessor each aims at; heads of more than 128 take 32 keys per block (the short tile otherwise).
# On an H200 the long tile at 2 per SM took 13-27% off a call from 2048 keys on; below, the short tile won.
TILE, LONG_TILE, LONG = (64, 4, 3), (128, 4, 2), 2048
PER_SM, LONG_PER_SM = 4, 2

_COUNTERS: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (batch, kv head), kept per device; each launch leaves them zero again."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def _n_splits(device: torch.device, b: int, hkv: int, lk: int, block_n: int, per_sm: int = PER_SM):
    sms = sm_count(device)
    blocks = -(-lk // block_n)
    n_splits = max(1, min(blocks, -(-per_sm * sms // (b * hkv)), 128))
    split_len = -(-blocks // n_splits) * block_n
    return -(-lk // split_len), split_len


def _uses_keys(meta: AttentionMeta, lk: int) -> bool:
    km, cp = meta.key_mask, meta.cache_position
    return km is not None and cp is not None and km.shape[-1] >= lk


def accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta, options=DEFAULT):
    """None for a one-query inference step this kernel takes, else why not (the registry's next choice runs)."""
    lq, lk = q.shape[2], k.shape[2]
    if lq != 1:
        return "not a one-query step"
    if lk == 0:
        return "no keys"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "needs gradients"
    if _uses_keys(meta, lk):
        return None
    mask = meta.mask
    if mask is not None and (mask.shape[-2] != 1 or mask.dtype == torch.bool):
        return "boolean or multi-query mask"
    if mask is None and meta.window is not None:
        return "sliding window without the key mask"
    return None


def decode_attention(q, k, v, meta: AttentionMeta, options=DEFAULT) -> torch.Tensor:
    """Flash-decoding for Lq == 1 (inference), on inputs ``accepts`` took."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    key_mask, cache_pos = meta.key_mask, meta.cache_position
    use_keys = _uses_keys(meta, lk)
    mask = None if use_keys else meta.mask
    n_rep = hq // hkv
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    long = lk >= LONG and d <= 128
    block_n, num_warps, num_stages = LONG_TILE if long else TILE if d <= 128 else (32, TILE[1], TILE[2])
    n_splits, split_len = _n_splits(q.device, b, hkv, lk, block_n, LONG_PER_SM if long else PER_SM)
    rows = b * hq * n_splits if n_splits > 1 else 1
    acc = torch.empty((rows, d), dtype=torch.float32, device=q.device)
    m = torch.empty((rows,), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    counters = _counters(q.device, b * hkv)
    if mask is not None:
        mask = mask.expand(b, 1, 1, lk)
    if use_keys:
        key_mask = key_mask.view(torch.int8) if key_mask.dtype == torch.bool else key_mask
        if key_mask.stride(-1) != 1:
            key_mask = key_mask.contiguous()
    out = torch.empty((b, hq, 1, d), dtype=q.dtype, device=q.device)
    upcast = INTERPRET or q.dtype == torch.float32
    red_r = max(2, triton.next_power_of_2(n_rep))
    _decode_kernel[(b * hkv, n_splits)](
        q, k, v, mask if mask is not None else q, key_mask if use_keys else q, cache_pos if use_keys else q,
        acc, m, l, counters, out,
        lk, hkv, n_rep, split_len, n_splits, float(meta.scale), int(meta.window or 0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0) if mask is not None else 0, mask.stride(3) if mask is not None else 0,
        key_mask.stride(0) if use_keys else 0, out.stride(0), out.stride(1),
        D=d, MASK_KIND=2 if use_keys else (1 if mask is not None else 0),
        BLOCK_R=max(16, triton.next_power_of_2(n_rep)), BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        RED_R=red_r, RED_S=max(2, min(triton.next_power_of_2(n_splits), 4096 // (red_r * max(16, d)) or 1)),
        UPCAST=upcast, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOWED=use_keys and meta.window is not None, num_warps=num_warps, num_stages=num_stages,
        **pdl_options(q.device, options),
    )  # fmt: skip
    return out
