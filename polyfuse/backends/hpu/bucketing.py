"""Static-shape helpers for generation: bucketed lengths, left padding, KV-cache growth.

Device-agnostic (no habana imports): HPU graphs and CUDA graphs both need a small set of fixed shapes.

``bucket_size <= 0``: one static shape, prompt_len + max_new_tokens. ``bucket_size > 0``: shapes are multiples of
bucket_size, grown one bucket at a time, like optimum-habana's ``incrementor``: the first allocation is the smallest
multiple *strictly greater* than the prompt length, so the first generated token always has a slot.
"""

from __future__ import annotations

from typing import Optional

import torch


def bucketed_length(prompt_len: int, max_new_tokens: int, bucket_size: int) -> int:
    """Sequence length allocated for the first step (prompt + room for generated tokens)."""
    if prompt_len < 0 or max_new_tokens < 0:
        raise ValueError(
            f"bucketed_length: negative length (prompt_len={prompt_len}, max_new_tokens={max_new_tokens})"
        )
    if bucket_size <= 0:
        return prompt_len + max_new_tokens
    return (prompt_len // bucket_size + 1) * bucket_size


def next_cache_length(current: int, needed: int, bucket_size: int, max_len: Optional[int] = None) -> int:
    """Length the KV cache should have so that ``needed`` positions fit.

    Returns ``current`` when they already fit. Otherwise, with ``bucket_size > 0``, the next multiple of bucket_size
    that holds ``needed`` (capped at ``max_len`` when given); with ``bucket_size <= 0``, ``max_len`` (or ``needed``).
    Raises ValueError when ``needed > max_len``.
    """
    if max_len is not None and max_len > 0 and needed > max_len:
        raise ValueError(f"next_cache_length: {needed} positions needed, more than max_len={max_len}")
    if needed <= current:
        return current
    if bucket_size <= 0:
        return max_len if max_len else needed
    grown = -(-needed // bucket_size) * bucket_size
    if max_len:
        grown = min(grown, max_len)
    return grown


def pad_to_length(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], length: int, pad_id: int):
    """Left-pad (or truncate) a left-padded batch to exactly ``length`` columns, for ``--max_input_tokens > 0``.

    Each row keeps its real tokens (attention_mask == 1); a row longer than ``length`` keeps its first ``length``
    tokens, as a tokenizer with ``truncation=True`` and the default right truncation side does. Returns
    ``(input_ids, attention_mask)`` of shape [B, length]; the mask keeps its dtype (int64 when it was None).
    """
    if length <= 0:
        raise ValueError(f"pad_to_length: length must be > 0, got {length}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    b, width = input_ids.shape
    keep = attention_mask.bool()
    if width <= length and _is_left_padded(keep):
        pad = length - width
        ids = torch.full((b, pad), pad_id, dtype=input_ids.dtype, device=input_ids.device)
        mask = torch.zeros((b, pad), dtype=attention_mask.dtype, device=attention_mask.device)
        return torch.cat([ids, input_ids], 1), torch.cat([mask, attention_mask], 1)
    out_ids = torch.full((b, length), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    out_mask = torch.zeros((b, length), dtype=attention_mask.dtype, device=attention_mask.device)
    for row in range(b):
        real = input_ids[row][keep[row]][:length]
        n = real.shape[0]
        if n:
            out_ids[row, length - n :] = real
            out_mask[row, length - n :] = 1
    return out_ids, out_mask


def _is_left_padded(keep: torch.Tensor) -> bool:
    # Once a row has a real token, every later column is real too.
    return bool((keep.int().cummax(1).values == keep.int()).all())


def valid_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """int32 [B] real tokens per row: ``AttentionMeta.valid_lengths`` (FusedSDPA's valid_sequence_lengths)."""
    return attention_mask.sum(1, dtype=torch.int32)
