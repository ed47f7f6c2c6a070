"""Attention on Gaudi: Habana's FusedSDPA kernel, plus the eager path with ``--attn_softmax_bf16``.

``fused_sdpa`` calls ``FusedSDPA.apply`` with the 11 positional arguments in the order optimum-habana's Llama uses
(q, k, v, attn_mask, dropout_p, is_causal, scale, softmax_mode, recompute_mode, valid_sequence_lengths, padding_side):

* decode (``meta.decode``):             (q, k, v, mask, 0.0, False, None, "None", False, None, "None")
* prefill with ``meta.causal_prefill``: (q, k, v, None, 0.0, True, None, softmax_mode, recompute, valid_lengths, "left")
* prefill otherwise:                    (q, k, v, mask, 0.0, False, None, softmax_mode, recompute, None, "None")

with ``softmax_mode = "fast" if meta.fast_softmax else "None"``. Choices made where optimum-habana gives no answer:

* Grouped-query attention: k and v are repeated to q's head count (``repeat_kv``) before the call. optimum-habana
  sometimes reshapes q to [B, Hkv, n_rep * Lq, D] instead, which is only valid with a per-row mask (not with the
  kernel's causal mode), so the repeat is the one layout that is right for every call path. It costs a copy of k/v.
* ``scale`` is passed as None (the kernel's 1/sqrt(D)) when ``meta.scale`` is that value, as optimum-habana does;
  any other scale is passed explicitly.
* The causal mode is only used when Lq == Lk: whether the kernel aligns a causal mask top-left or bottom-right for
  Lq != Lk is not documented, so those calls pass an explicit bottom-right mask instead (the native semantics).
  A prefill with ``meta.mask is None and meta.is_causal`` (no padding) uses the causal mode without lengths.
* The additive mask is cast to q's dtype when it differs.
"""

from __future__ import annotations

import math

import torch

from polyfuse.backends.hpu import _habana
from polyfuse.ops.attention import AttentionMeta, causal_mask, repeat_kv


def _kernel():
    return _habana.require(_habana.KERNELS, "FusedSDPA")


def _scale_arg(meta: AttentionMeta, head_dim: int):
    default = 1.0 / math.sqrt(head_dim)
    return None if math.isclose(meta.scale, default, rel_tol=1e-6) else float(meta.scale)


def fused_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    fsdpa = _kernel()
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scale = _scale_arg(meta, q.shape[-1])
    mask = meta.mask
    if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    q_len, k_len = q.shape[2], k.shape[2]

    if meta.decode:
        return fsdpa.apply(q, k, v, mask, 0.0, False, scale, "None", False, None, "None")

    softmax_mode = "fast" if meta.fast_softmax else "None"
    recompute = bool(meta.recompute)
    if q_len == k_len:
        if meta.causal_prefill:
            lengths = meta.valid_lengths
            if lengths is not None and lengths.dtype != torch.int32:
                lengths = lengths.to(torch.int32)
            return fsdpa.apply(q, k, v, None, 0.0, True, scale, softmax_mode, recompute, lengths, "left")
        if mask is None and meta.is_causal:
            return fsdpa.apply(q, k, v, None, 0.0, True, scale, softmax_mode, recompute, None, "None")
    elif mask is None and meta.is_causal and q_len > 1:
        mask = causal_mask(q_len, k_len, q.device, q.dtype)
    return fsdpa.apply(q, k, v, mask, 0.0, False, scale, softmax_mode, recompute, None, "None")
