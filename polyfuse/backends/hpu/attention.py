"""Attention on Gaudi: Habana's FusedSDPA kernel, plus the eager path with ``--attn_softmax_bf16``.

``fused_sdpa`` calls ``FusedSDPA.apply`` with the 11 positional arguments in the order optimum-habana's Llama uses
(q, k, v, attn_mask, dropout_p, is_causal, scale, softmax_mode, recompute_mode, valid_sequence_lengths, padding_side):

* decode (``meta.decode``):             (q, k, v, mask, 0.0, False, None, "None", False, None, "None")
* prefill with ``meta.causal_prefill``: (q, k, v, None, 0.0, True, None, softmax_mode, recompute, valid_lengths, "left")
* prefill otherwise:                    (q, k, v, mask, 0.0, False, None, softmax_mode, recompute, None, "None")

with ``softmax_mode = "fast" if meta.fast_softmax else "None"``. Choices made where optimum-habana gives no answer:

* Grouped-query attention: k and v go to the kernel unrepeated ([B, Hkv, Lk, D] next to q [B, Hq, Lq, D]), as
  optimum-habana 1.21's Llama passes them on its FusedSDPA path (modeling_llama.py, ``pre_attn_forward``: the same
  ``query_states, key_states, value_states`` in all three calls; only its eager path, ``gaudi_eager_attention_forward``,
  reshapes q to [B, Hkv, n_rep, Lq, D] itself, through ``gaudi_llama_repeat_kv``). The kernel does grouped-query
  attention on its own: Habana's hpex/kernels/FusedSDPA.py reshapes q to [B, Hkv, n_rep, Lq, D], k/v to
  [B, Hkv, 1, Lk, D] and the mask (head dim 1 or Hq) when Hkv is neither Hq nor 1, and reshapes the output back.
  No copy of the KV cache per layer and step.
* ``scale`` is passed as None (the kernel's 1/sqrt(D)) when ``meta.scale`` is that value, as optimum-habana does;
  any other scale is passed explicitly.
* The causal mode is only used when Lq == Lk: whether the kernel aligns a causal mask top-left or bottom-right for
  Lq != Lk is not documented, so those calls pass an explicit bottom-right mask instead (the native semantics).
  A prefill with ``meta.mask is None and meta.is_causal`` (no padding) uses the causal mode without lengths.
* ``valid_sequence_lengths`` (with ``meta.padding_side``, "left" from the generation loop) only when they exist and
  no gradient is needed: Habana's kernel asserts "Valid sequence length is supported only in inference with
  is_causal(triangular) mask case". Training (q, k or v requiring grad), or a call with a padding mask and no lengths
  (the transformers-patch path), takes the masked path: the mask is never dropped, and the result is right for any
  padding side (training collators pad on the right).
* With gradients on, recompute mode and no causal flag, ``softmax_mode`` stays "None": the kernel asserts that its
  fast softmax trains in recompute mode only with the causal flag.
* The additive mask is cast to q's dtype when it differs.
* A sliding window (``meta.window``, Mistral) always takes the masked path: the mask carries the window.
"""

from __future__ import annotations

import math

import torch

from polyfuse.backends.hpu import _habana
from polyfuse.ops.attention import AttentionMeta, causal_mask


def _kernel():
    return _habana.require(_habana.KERNELS, "FusedSDPA")


def _scale_arg(meta: AttentionMeta, head_dim: int):
    default = 1.0 / math.sqrt(head_dim)
    return None if math.isclose(meta.scale, default, rel_tol=1e-6) else float(meta.scale)


def _requires_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The kernel's own test (``requires_backward = q.requires_grad or k.requires_grad or v.requires_grad``)."""
    return q.requires_grad or k.requires_grad or v.requires_grad


def fused_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    fsdpa = _kernel()
    scale = _scale_arg(meta, q.shape[-1])
    mask = meta.mask
    if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    q_len, k_len = q.shape[2], k.shape[2]

    if meta.decode:
        return fsdpa.apply(q, k, v, mask, 0.0, False, scale, "None", False, None, "None")

    backward = _requires_backward(q, k, v)
    softmax_mode = "fast" if meta.fast_softmax else "None"
    recompute = bool(meta.recompute)
    if q_len == k_len and meta.window is None:
        if mask is None and meta.is_causal:
            return fsdpa.apply(q, k, v, None, 0.0, True, scale, softmax_mode, recompute, None, "None")
        lengths = meta.valid_lengths
        if meta.causal_prefill and lengths is not None and not backward:
            if lengths.dtype != torch.int32:
                lengths = lengths.to(torch.int32)
            return fsdpa.apply(q, k, v, None, 0.0, True, scale, softmax_mode, recompute, lengths, meta.padding_side)
    if mask is None and meta.is_causal and (q_len > 1 or meta.window is not None):
        mask = causal_mask(q_len, k_len, q.device, q.dtype, meta.window)
    if backward and recompute:
        softmax_mode = "None"
    return fsdpa.apply(q, k, v, mask, 0.0, False, scale, softmax_mode, recompute, None, "None")
