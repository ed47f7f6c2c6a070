"""Next-token choice: greedy, or sampling with transformers' order of warpers (temperature, top-k, top-p)."""

from __future__ import annotations

from typing import Optional

import torch


def warp(
    logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None
) -> torch.Tensor:
    """fp32 scores after temperature, top-k and top-p (dropped tokens at -inf), in transformers' order."""
    scores = logits.float()
    if temperature != 1.0:
        scaled = scores / temperature
        if temperature < 1.0:
            # A temperature so small that finite scores overflow (1e-40: +-inf, then inf - inf = nan in the
            # softmax; transformers' warper then fails in multinomial) takes the T -> 0 limit instead: the top
            # tokens at 0, every other at -inf, i.e. greedy (ties share the draw). Rows that stay finite keep
            # transformers' exact values; no host sync.
            shifted = scores - scores.amax(dim=-1, keepdim=True)
            limit = torch.where(shifted == 0, 0.0, shifted / temperature)
            overflow = (torch.isfinite(scores) & ~torch.isfinite(scaled)).any(dim=-1, keepdim=True)
            scaled = torch.where(overflow, limit, scaled)
        scores = scaled
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[:, -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop_sorted.scatter(1, idx, drop_sorted), float("-inf"))
    return scores


def next_token(
    logits: torch.Tensor,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if not do_sample:
        return logits.argmax(dim=-1)
    return draw(warp(logits, temperature, top_k, top_p), generator)


def draw(scores: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row [B] drawn from softmax(``scores`` [B, V]) (warped scores: dropped tokens at -inf)."""
    probs = scores.softmax(dim=-1)
    if generator is not None and generator.device.type != probs.device.type:
        # A generator on another device (a CPU one for HPU tensors): draw on the generator's device.
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def validate_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
