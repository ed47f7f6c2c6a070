"""Logits processors applied before the token choice, with transformers' semantics.

``repetition_penalty`` is transformers' ``RepetitionPenaltyLogitsProcessor``: every token id present in the row so
far (prompt, left padding included as transformers 4.x counts it, left out as 5.x does; then every generated token) has
its score divided by the penalty where positive and multiplied by it where negative. The row's "seen" ids are kept as
a persistent bool mask [rows, vocab] updated in place with one ``scatter_`` per token, so the greedy in-place
``TokenStep`` applies it inside its CUDA graph (no host work per token).
"""

from __future__ import annotations

import inspect

import torch


def _penalty_skips_padding() -> bool:
    """Does the installed transformers' generate() leave the prompt's left padding out of the repetition penalty
    (5.x passes the padding lengths as ``prompt_ignore_length``; 4.55 counts the padding)?"""
    from transformers.generation.utils import GenerationMixin

    try:
        return "prompt_ignore_length" in inspect.getsource(GenerationMixin._get_logits_processor)
    except (OSError, TypeError):  # no source shipped: 4.x's behaviour
        return False


PENALTY_SKIPS_PADDING = _penalty_skips_padding()


def seen_mask(ids: torch.Tensor, vocab: int, out: torch.Tensor | None = None, mask=None) -> torch.Tensor:
    """bool [rows, vocab], True at every id present in ``ids`` [rows, L]; written into ``out`` when given. With
    ``mask`` [rows, L] (False: left padding) and a transformers whose penalty skips the padding (5.x's
    ``prompt_ignore_length``), padded positions count as not seen."""
    if out is None:
        out = torch.zeros(ids.shape[0], vocab, dtype=torch.bool, device=ids.device)
    else:
        out.zero_()
    if mask is None or not PENALTY_SKIPS_PADDING:
        return out.scatter_(1, ids, True)
    wide = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)  # column vocab: padding
    wide.scatter_(1, ids.masked_fill(~mask, vocab), True)
    return out.copy_(wide[:, :vocab])


def mark_seen_(seen: torch.Tensor, tokens: torch.Tensor) -> None:
    """Add ``tokens`` [rows] to each row's seen ids, in place."""
    seen.scatter_(1, tokens[:, None], True)


def penalize(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty on fp32 ``scores`` [rows, vocab] at the ``seen`` ids (elementwise the same
    arithmetic as its gather / where / scatter, so bitwise the same scores)."""
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
