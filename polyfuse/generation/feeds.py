"""Where a strategy's next logits come from once it has chosen tokens: the decode step over the KV cache, or (with
``use_cache=False``) a forward of the whole sequence. ``feed(tokens, i)`` feeds token i of every row;
``feed.beams(tokens, beam_idx, i)`` first reorders the rows by parent beam (beam search)."""

from __future__ import annotations

import torch

from polyfuse.generation.beam_search import reorder_cache_
from polyfuse.generation.kv_cache import kv_len_at


class CachedFeed:
    """The runtime-wrapped ``decode`` step (polyfuse.generation.steps) at cache slot n + i."""

    def __init__(self, model, decode, key_mask, position_ids, bucket_size: int):
        self.decode, self.cache, self.key_mask, self.bucket_size = decode, model.cache, key_mask, bucket_size
        self.n = position_ids.shape[1]
        self.first_pos = position_ids[:, -1:] + 1  # each row's position of its first new token
        self.pos = self.first_pos
        # One tensor advanced in place, like optimum-habana's token_idx: HPU graphs key on input views, so a moving
        # slice of a positions tensor would capture a new graph every token.
        self.cache_position = torch.full((1,), self.n, dtype=torch.long, device=key_mask.device)

    def kv_len(self, i: int) -> int:
        return kv_len_at(self.n + i, self.bucket_size, self.cache.max_len)

    def __call__(self, tokens: torch.Tensor, i: int) -> torch.Tensor:
        logits = self.decode(self.kv_len(i), tokens[:, None], self.pos, self.cache_position, self.key_mask)
        self.cache_position.add_(1)
        self.pos = self.pos + 1
        return logits

    def beams(self, tokens: torch.Tensor, beam_idx: torch.Tensor, i: int) -> torch.Tensor:
        reorder_cache_(self.cache, beam_idx, self.n + i)  # in place: captured decode graphs stay valid
        self.cache_position.fill_(self.n + i)
        return self.decode(self.kv_len(i), tokens[:, None], self.first_pos + i, self.cache_position, self.key_mask)


class FullForwardFeed:
    """No cache: the model's cache-less forward over prompt + tokens so far, every token (the baseline the KV cache
    is measured against)."""

    def __init__(self, model, input_ids: torch.Tensor, mask: torch.Tensor):
        self.model, self.ids, self.mask = model, input_ids, mask

    def logits(self) -> torch.Tensor:
        pos = (self.mask.long().cumsum(-1) - 1).masked_fill(~self.mask, 1)
        return self.model(self.ids, attention_mask=self.mask, position_ids=pos).logits[:, -1]

    def _append(self, tokens: torch.Tensor) -> torch.Tensor:
        self.ids = torch.cat([self.ids, tokens[:, None]], 1)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        return self.logits()

    def __call__(self, tokens: torch.Tensor, i: int) -> torch.Tensor:
        return self._append(tokens)

    def beams(self, tokens: torch.Tensor, beam_idx: torch.Tensor, i: int) -> torch.Tensor:
        self.ids = self.ids.index_select(0, beam_idx)
        return self._append(tokens)
