"""Attention with grouped-query heads over a (possibly preallocated) key/value sequence.

q [B, Hq, Lq, D]; k, v [B, Hkv, Lk, D] with Hq % Hkv == 0; returns [B, Hq, Lq, D].
``AttentionMeta`` is built once per forward by the model and shared by every layer:
  * ``mask``: additive float mask [B, 1, Lq, Lk] (0 keeps, dtype-min drops), or None when ``is_causal`` says all;
  * ``is_causal``: q and k are the same positions with no padding, so a causal mask is all that is needed;
  * ``valid_lengths``: int32 [B] real tokens per row (left padding), for kernels that take lengths, not masks;
  * ``decode``: Lq == 1 against a KV cache;
  * ``key_mask`` (bool [B, >=Lk], False: left padding) and ``cache_position`` ([Lq], the queries' cache slots): the
    mask's sources, set for cached steps. A kernel that reads them (the Triton decode kernel) never needs ``mask``;
    ``mask`` is then built on first access from them (``lazy_mask``), so a decode step launches no mask kernels
    unless an implementation asks for it;
  * ``window``: sliding-window attention (Mistral, Qwen2's windowed layers): the query at slot p sees key slot j
    only when ``p - window < j <= p``; None: every earlier key. Every implementation honours it;
  * run options copied from the flags once at build time (``options_from_flags``): ``causal_prefill`` (--flash_attention_causal_mask: use the
    causal flag plus ``valid_lengths`` instead of the mask on prefill), ``recompute`` (--flash_attention_recompute),
    ``fast_softmax`` (--flash_attention_fast_softmax), ``softmax_bf16`` (--attn_softmax_bf16, eager paths).
The native reference is eager attention (matmul, fp32 softmax, matmul), the same math as transformers' eager path.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from polyfuse.core.registry import OpSpec, declare


@dataclass
class AttentionMeta:
    scale: float
    mask: Optional[torch.Tensor] = None
    is_causal: bool = False
    valid_lengths: Optional[torch.Tensor] = None
    decode: bool = False
    padding_side: str = "left"
    causal_prefill: bool = False
    recompute: bool = False
    fast_softmax: bool = False
    softmax_bf16: bool = False
    key_mask: Optional[torch.Tensor] = None
    cache_position: Optional[torch.Tensor] = None
    lazy_mask: Optional[Callable[[], torch.Tensor]] = None
    window: Optional[int] = None


# AttentionMeta field -> the run flag it is copied from.
OPTION_FLAGS = {
    "causal_prefill": "flash_attention_causal_mask",
    "recompute": "flash_attention_recompute",
    "fast_softmax": "flash_attention_fast_softmax",
    "softmax_bf16": "attn_softmax_bf16",
}


def options_from_flags(flags: dict) -> dict:
    """The AttentionMeta run options a run's flags ask for (device checks have already turned off the rest)."""
    return {field: bool(flags.get(flag)) for field, flag in OPTION_FLAGS.items()}


def _get_mask(self):
    m = self.__dict__.get("_mask")
    if m is None and self.lazy_mask is not None:
        m = self.__dict__["_mask"] = self.lazy_mask()
    return m


def _set_mask(self, value):
    self.__dict__["_mask"] = value


AttentionMeta.mask = property(_get_mask, _set_mask)  # the dataclass __init__ assigns through the setter


def _visible(keys: torch.Tensor, queries: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """bool [Lq, Lk]: key slot j visible to query slot p (j <= p, and p - j < window with a window)."""
    seen = keys[None, :] <= queries[:, None]
    if window is not None:
        seen &= keys[None, :] > queries[:, None] - window
    return seen


def cache_mask(key_mask: torch.Tensor, cache_position: torch.Tensor, kv_len: int, dtype, window=None) -> torch.Tensor:
    """Additive [B, 1, Lq, kv_len] mask: key j is visible to the query at slot p when it is real and j <= p (and
    within the window)."""
    keys = torch.arange(kv_len, device=cache_position.device)
    allowed = key_mask[:, None, None, :kv_len] & _visible(keys, cache_position, window)[None, None]
    return torch.zeros((), dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def causal_mask(q_len: int, k_len: int, device, dtype, window=None) -> torch.Tensor:
    """Additive [1, 1, q_len, k_len] mask for q positions aligned to the last q_len keys."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    allowed = _visible(torch.arange(k_len, device=device), q_pos, window)
    return torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def attention_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    """Grouped-query heads without repeating k/v: the n_rep query heads of each kv head are folded into the rows of
    one matmul ([B, Hkv, n_rep * Lq, D] @ [B, Hkv, D, Lk]), so the KV cache is read as it is, with no copy per layer
    and token (a repeated k/v is n_rep times the KV traffic); head h = g * n_rep + r, as ``repeat_kv`` orders them."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    n_rep = hq // hkv
    scores = torch.matmul(q.reshape(b, hkv, n_rep * lq, d), k.transpose(2, 3)) * meta.scale
    mask = meta.mask
    if mask is None and meta.is_causal and (lq > 1 or meta.window is not None):
        mask = causal_mask(lq, lk, q.device, scores.dtype, meta.window)
    if mask is not None:
        grouped = scores.view(b, hkv, n_rep, lq, lk)
        m = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(mask.shape[0], hkv, n_rep, lq, lk)
        scores = (grouped + m).view(b, hkv, n_rep * lq, lk)
    softmax_dtype = q.dtype if meta.softmax_bf16 else torch.promote_types(q.dtype, torch.float32)
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype)
    return torch.matmul(probs, v).view(b, hq, lq, d)


SPEC = declare(
    OpSpec(
        "attention",
        "attention(q[B,Hq,Lq,D], k[B,Hkv,Lk,D], v[B,Hkv,Lk,D], meta: AttentionMeta) -> out[B,Hq,Lq,D]",
        attention_native,
        enable_flag="use_flash_attention",
    )
)
