"""Rotary fused with the KV-cache write, in one Triton launch (inference only).

Grid: (B * L, head blocks of q + head blocks of k). q blocks rotate into a new q; k blocks rotate k straight into
``k_cache[b, h, cache_position[l]]`` and copy v into ``v_cache`` at the same slot, so a decode step spends one
kernel per layer here instead of three (rotary, two index_copy_).
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton.rotary import _cos_sin, _load_cos_sin, _rotate_block, _unit_last
from polyfuse.core.kernel_options import DEFAULT


@triton.jit
def _rotary_kv_write_kernel(
    Q, K, V, QO, KC, VC, COS, SIN, POS, L, HQ, HKV,
    sq_b, sq_h, sq_l, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, oq_b, oq_h, oq_l,
    kc_b, kc_h, kc_l, vc_b, vc_h, vc_l, sc_b, sc_l, ss_b, ss_l,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    pid_bl = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    b = pid_bl // L
    l = pid_bl % L
    d, d_mask, c1, c2, s1, s2 = _load_cos_sin(COS + b * sc_b + l * sc_l, SIN + b * ss_b + l * ss_l, HALF, BLOCK_HALF)
    n_q_blocks = tl.cdiv(HQ, BLOCK_H)
    if pid_h < n_q_blocks:
        heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_block(
            Q + b * sq_b + l * sq_l, QO + b * oq_b + l * oq_l, sq_h, oq_h, heads, HQ, d, d_mask, c1, c2, s1, s2,
            HALF, False,
        )  # fmt: skip
    else:
        heads = (pid_h - n_q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        pos = tl.load(POS + l).to(tl.int64)
        _rotate_block(
            K + b * sk_b + l * sk_l, KC + b * kc_b + pos * kc_l, sk_h, kc_h, heads, HKV, d, d_mask, c1, c2, s1, s2,
            HALF, False,
        )  # fmt: skip
        mask = (heads < HKV)[:, None] & d_mask[None, :]
        src = V + b * sv_b + l * sv_l + heads[:, None] * sv_h + d[None, :]
        dst = VC + b * vc_b + pos * vc_l + heads[:, None] * vc_h + d[None, :]
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
        tl.store(dst + HALF, tl.load(src + HALF, mask=mask), mask=mask)


def accepts(q, k, v, cos, sin, k_cache, v_cache, cache_position, options=DEFAULT):  # size: the op's signature
    """None when the kernel takes these inputs, else why not (the registry's next choice runs)."""
    return (
        "odd head dim" if q.shape[-1] % 2
        else "cache not contiguous in the head dim" if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1
        else "cache dtype differs from k" if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype
        else None
    )  # fmt: skip


def rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, cache_position, options=DEFAULT):  # size: the op's signature
    b, hq, length, d = q.shape
    hkv = k.shape[1]
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    cos, sin = _cos_sin(cos, b, length, d), _cos_sin(sin, b, length, d)
    qo = torch.empty_like(q)
    half = d // 2
    block_h = min(triton.next_power_of_2(max(hq, hkv)), 16)
    grid = (b * length, triton.cdiv(hq, block_h) + triton.cdiv(hkv, block_h))
    _rotary_kv_write_kernel[grid](
        q, k, v, qo, k_cache, v_cache, cos, sin, cache_position, length, hq, hkv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), qo.stride(0), qo.stride(1), qo.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_H=block_h, num_warps=4,
        **pdl_options(q.device, options),
    )  # fmt: skip
    return qo
