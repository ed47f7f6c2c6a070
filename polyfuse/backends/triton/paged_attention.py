"""Paged attention in Triton, keys read through the block table (inference only): a decode kernel (one query per
sequence) and a prefill kernel (chunks of queries per sequence).

Grid (sequences, kv heads, splits). A program takes the n_rep query heads of one kv head (a [16+, D] tile, so each
key block is read once per group) and an equal share of the key range of its sequence (split-K, so a small batch
still fills the GPU): for each tile of BLOCK_N keys it looks up the tiles' blocks in the sequence's row of the
block table (``block_tables[s, key // block_size]``), loads the keys and values from the [blocks, block_size, Hkv,
D] cache and runs an online softmax (fp32 max / sum / weighted values). Keys at or past ``seq_lens[s]`` are not read,
so a table as wide as ``max_model_len`` (a CUDA graph captured once per batch size) costs no more than a narrow one.
With one split the program writes the output; with several it writes its partials and a second small kernel
combines them. The split count depends only on the batch and the table's width (static under a graph). A
sliding window (``meta.window``) masks keys at or before ``seq_len - 1 - window``. The decode kernel declines prefill
chunks (``accepts``), and the registry's next choice, the prefill kernel, takes them.

The prefill kernel is flash attention over paged keys: grid (sequences x query tiles, query heads); a program takes
BLOCK_M of a sequence's queries (their rows of q found through ``q_index``) and walks the key tiles up to the tile's
last position, masking each query's keys past its own position (causal, with the cached prefix before the chunk),
online softmax in fp32. Nothing of size queries x keys is stored, whatever the chunk and the context. Padded query
slots (``out_index`` does not point back at them) are not written.
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._online_softmax import online_softmax_step
from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._rounding import INTERPRET, cast_rne
from polyfuse.backends.triton._util import sm_count
from polyfuse.ops.paged_attention import PagedMeta


@triton.jit
def _paged_kv_tile(K, V, TABLE_ROW, keys, n_mask, g, dd, d_mask, sk_n, sk_b, sk_h, sv_n, sv_b, sv_h,
                   BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """Keys and values [N, D] of kv head ``g`` at positions ``keys``, found through one block-table row."""
    block = tl.load(TABLE_ROW + keys // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    offset = keys % BLOCK_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K + block[:, None] * sk_n + offset[:, None] * sk_b + g * sk_h + dd[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + block[:, None] * sv_n + offset[:, None] * sv_b + g * sv_h + dd[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _paged_decode_kernel(
    Q, K, V, TABLES, LENS, OUT, ACC, M_OUT, L_OUT,
    N_REP, split_len, n_splits, scale, window,
    sq_s, sq_h, sk_n, sk_b, sk_h, sv_n, sv_b, sv_h, st_s, so_s, so_h,
    D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    s = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    split = tl.program_id(2)
    r = tl.arange(0, BLOCK_R)
    dd = tl.arange(0, BLOCK_D)
    nn = tl.arange(0, BLOCK_N)
    r_mask = r < N_REP
    d_mask = dd < D
    heads = g * N_REP + r
    q = tl.load(Q + s * sq_s + heads[:, None] * sq_h + dd[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    seq_len = tl.load(LENS + s)
    m_i = tl.full([BLOCK_R], -1.0e38, tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + nn
        n_mask = keys < end
        k, v = _paged_kv_tile(K, V, TABLES + s * st_s, keys, n_mask, g, dd, d_mask, sk_n, sk_b, sk_h, sv_n, sv_b, sv_h,
                              BLOCK_SIZE, UPCAST)  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        valid = n_mask
        if WINDOWED:
            valid = valid & (keys > seq_len - 1 - window)
        scores = tl.where(valid[None, :], scores, -float("inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, v, UPCAST, PRECISION)
    out_mask = r_mask[:, None] & d_mask[None, :]
    if n_splits == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            OUT + s * so_s + heads[:, None] * so_h + dd[None, :], cast_rne(out, OUT.dtype.element_ty), mask=out_mask
        )
    else:
        row = (s * N_REP * tl.num_programs(1) + heads) * n_splits + split
        tl.store(M_OUT + row, m_i, mask=r_mask)
        tl.store(L_OUT + row, l_i, mask=r_mask)
        tl.store(ACC + row[:, None] * D + dd[None, :], acc, mask=out_mask)


@triton.jit
def _combine_kernel(ACC, M_IN, L_IN, OUT, HQ, n_splits, so_s, so_h, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_S: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """One program per (sequence, query head): the splits' partials rescaled to a common max, summed, normalized."""
    wait_prior(PDL)
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ss = tl.arange(0, BLOCK_S)
    dd = tl.arange(0, BLOCK_D)
    s_mask = ss < n_splits
    d_mask = dd < D
    rows = (s * HQ + h) * n_splits + ss
    m = tl.load(M_IN + rows, mask=s_mask, other=-1.0e38)
    l = tl.load(L_IN + rows, mask=s_mask, other=0.0)
    a = tl.load(ACC + rows[:, None] * D + dd[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(s_mask, tl.exp(m - m_max), 0.0)
    total = tl.sum(l * w, axis=0)
    out = tl.sum(a * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + s * so_s + h * so_h + dd, cast_rne(out, OUT.dtype.element_ty), mask=d_mask)


@triton.jit
def _paged_prefill_kernel(
    Q, K, V, TABLES, Q_INDEX, Q_POS, OUT_INDEX, OUT,
    N_REP, n_q, q_tiles, scale, window,
    sq_t, sq_h, sk_n, sk_b, sk_h, sv_n, sv_b, sv_h, st_s, so_t, so_h,
    D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    pid = tl.program_id(0)
    h = tl.program_id(1)
    s = (pid // q_tiles).to(tl.int64)
    m0 = (pid % q_tiles) * BLOCK_M
    g = h // N_REP
    mm = m0 + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    nn = tl.arange(0, BLOCK_N)
    in_grid = mm < n_q
    d_mask = dd < D
    rows = tl.load(Q_INDEX + s * n_q + mm, mask=in_grid, other=0)
    pos = tl.load(Q_POS + s * n_q + mm, mask=in_grid, other=0)
    back = tl.load(OUT_INDEX + rows, mask=in_grid, other=-1)
    real = in_grid & (back == s * n_q + mm)  # a padded slot's row belongs to another slot
    q = tl.load(Q + rows[:, None] * sq_t + h * sq_h + dd[None, :], mask=real[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e38, tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last = tl.max(tl.where(real, pos, 0), axis=0)
    first = 0
    if WINDOWED:
        first = tl.maximum(tl.min(tl.where(real, pos, last), axis=0) - window + 1, 0)
        first = (first // BLOCK_N) * BLOCK_N
    for n0 in range(first, last + 1, BLOCK_N):
        keys = n0 + nn
        n_mask = keys <= last
        k, v = _paged_kv_tile(K, V, TABLES + s * st_s, keys, n_mask, g, dd, d_mask, sk_n, sk_b, sk_h, sv_n, sv_b, sv_h,
                              BLOCK_SIZE, UPCAST)  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        seen = (keys[None, :] <= pos[:, None]) & n_mask[None, :]
        if WINDOWED:
            seen = seen & (keys[None, :] > pos[:, None] - window)
        scores = tl.where(seen, scores, -float("inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, v, UPCAST, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + rows[:, None] * so_t + h * so_h + dd[None, :], cast_rne(out, OUT.dtype.element_ty),
             mask=real[:, None] & d_mask[None, :])  # fmt: skip


BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 4, 2
PREFILL_TILE = (64, 64, 4, 2)  # queries, keys, warps, stages of a prefill program
PER_SM, MAX_SPLITS = 4, 64


def _splits(device, n_seqs: int, hkv: int, max_keys: int) -> tuple:
    """(splits, keys per split) from the batch and the table's width only, so a graph's launch never changes."""
    tiles = -(-max_keys // BLOCK_N)
    n = max(1, min(tiles, MAX_SPLITS, -(-PER_SM * sm_count(device) // (n_seqs * hkv))))
    split_len = -(-tiles // n) * BLOCK_N
    return -(-max_keys // split_len), split_len


def accepts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMeta):
    """None for a one-query-per-sequence inference step, else why not (the registry's next choice runs)."""
    if not meta.decode:
        return "not a decode step (a prefill chunk)"
    if q.shape[0] != meta.block_tables.shape[0]:
        return "not one query row per sequence"
    if torch.is_grad_enabled() and q.requires_grad:
        return "needs gradients"
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return "cache rows not contiguous"
    return None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMeta):
    """Attention of q [S, Hq, D] (one query per sequence) over its paged keys, on inputs ``accepts`` took."""
    s, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    n_rep = hq // hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    tables = meta.block_tables if meta.block_tables.stride(-1) == 1 else meta.block_tables.contiguous()
    n_splits, split_len = _splits(q.device, s, hkv, tables.shape[1] * block_size)
    out = torch.empty((s, hq, d), dtype=q.dtype, device=q.device)
    rows = s * hq * n_splits if n_splits > 1 else 1
    acc = torch.empty((rows, d), dtype=torch.float32, device=q.device)
    m = torch.empty((rows,), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    block_d = max(16, triton.next_power_of_2(d))
    pdl = pdl_options(q.device)
    _paged_decode_kernel[(s, hkv, n_splits)](
        q, k_cache, v_cache, tables, meta.seq_lens, out, acc, m, l,
        n_rep, split_len, n_splits, float(meta.scale), int(meta.window or 0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0), out.stride(0), out.stride(1),
        D=d, BLOCK_SIZE=block_size, BLOCK_R=max(16, triton.next_power_of_2(n_rep)), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        UPCAST=INTERPRET or q.dtype == torch.float32, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOWED=meta.window is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl,
    )  # fmt: skip
    if n_splits > 1:
        _combine_kernel[(s, hq)](
            acc, m, l, out, hq, n_splits, out.stride(0), out.stride(1),
            D=d, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(n_splits)), num_warps=4, **pdl,
        )  # fmt: skip
    return out


def accepts_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMeta):
    """None for a prefill (or any) paged call of inference, else why not."""
    if torch.is_grad_enabled() and q.requires_grad:
        return "needs gradients"
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return "cache rows not contiguous"
    return None


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedMeta):
    """Attention of the chunks' queries q [T, Hq, D] over their paged keys, on inputs ``accepts_prefill`` took."""
    t, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    tables = meta.block_tables if meta.block_tables.stride(-1) == 1 else meta.block_tables.contiguous()
    n_seqs, n_q = meta.q_index.shape
    q_index, q_pos = meta.q_index.contiguous(), meta.q_pos.contiguous()
    block_m, block_n, warps, stages = PREFILL_TILE
    block_m = min(block_m, max(16, triton.next_power_of_2(n_q)))
    q_tiles = -(-n_q // block_m)
    out = torch.empty_like(q)
    if t == 0:
        return out
    _paged_prefill_kernel[(n_seqs * q_tiles, hq)](
        q, k_cache, v_cache, tables, q_index, q_pos, meta.out_index, out,
        hq // hkv, n_q, q_tiles, float(meta.scale), int(meta.window or 0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tables.stride(0), out.stride(0), out.stride(1),
        D=d, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        UPCAST=INTERPRET or q.dtype == torch.float32, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOWED=meta.window is not None, num_warps=warps, num_stages=stages, **pdl_options(q.device),
    )  # fmt: skip
    return out
