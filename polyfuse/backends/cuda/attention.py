"""Attention on NVIDIA GPUs.

``sdpa_attention``: ``torch.nn.functional.scaled_dot_product_attention``.
  * prefill, ``meta.is_causal`` and no mask or window, Lq == Lk: ``is_causal=True`` (SDPA can pick the flash backend);
  * with an additive mask [B, 1, Lq, Lk]: the mask is passed (cast to q's dtype, clamped so that fp16 never sees
    -inf; the memory-efficient backend handles it);
  * grouped-query heads: decode (Lq == 1) folds the query heads of a group into the query length, so K/V are
    never repeated; otherwise ``enable_gqa=True`` (torch >= 2.5) or ``repeat_kv``.
Works on any device SDPA supports, CPU included.

A sliding window (``meta.window``) is always an explicit mask. The Triton split-K decode kernel is the portable
Triton backend's (``polyfuse.backends.triton.decode_attention``); the calls it declines come here.
"""

import torch
import torch.nn.functional as F

from polyfuse.ops.attention import AttentionMeta, causal_mask, repeat_kv


def _sdpa_has_gqa() -> bool:
    """``enable_gqa`` arrived in torch 2.5 (SDPA is a builtin without an inspectable signature)."""
    try:
        major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 5)


HAS_GQA = _sdpa_has_gqa()


def _prepare_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool or mask.dtype == dtype:
        return mask
    return mask.to(dtype).clamp_(min=torch.finfo(dtype).min)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    n_rep = hq // hkv
    mask = meta.mask
    is_causal = False
    if mask is None and meta.is_causal and (lq > 1 or meta.window is not None):
        if lq == lk and meta.window is None:
            is_causal = True
        else:  # SDPA's is_causal aligns to the top-left and knows no window; the op aligns q to the last keys
            mask = causal_mask(lq, lk, q.device, q.dtype, meta.window)
    if mask is not None:
        mask = _prepare_mask(mask, q.dtype)
    if n_rep > 1 and lq == 1 and (mask is None or mask.shape[-2] == 1):
        # Decode: the n_rep query heads of a group become n_rep query rows against the group's K/V.
        qf = q.reshape(b, hkv, n_rep, d)
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=meta.scale)
        return out.reshape(b, hq, 1, d)
    if n_rep > 1:
        if HAS_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=meta.scale, enable_gqa=True
            )
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=meta.scale)
