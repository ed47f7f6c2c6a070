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


class StaticFullForwardFeed:
    """No cache on a device that compiles per shape (``runtime.static_shapes``: Gaudi): the forward always runs over
    prompt + max_new_tokens positions, the future ones masked out, each new token written at a device-side column
    (optimum-habana's static shapes with ``token_idx``), so every token is the same graph. The logits of the last
    real position are those of the growing forward: causal attention never lets a position see a later one."""

    def __init__(self, model, input_ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, pad_token_id: int):
        rows, n = input_ids.shape
        self.model = model
        self.ids = torch.full((rows, n + max_new_tokens), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
        self.ids[:, :n] = input_ids
        self.mask = torch.zeros(rows, n + max_new_tokens, dtype=torch.bool, device=mask.device)
        self.mask[:, :n] = mask
        self.last = torch.full((1,), n - 1, dtype=torch.long, device=input_ids.device)

    def logits(self) -> torch.Tensor:
        pos = (self.mask.long().cumsum(-1) - 1).masked_fill(~self.mask, 1)
        logits = self.model(self.ids, attention_mask=self.mask, position_ids=pos).logits
        return logits.index_select(1, self.last).squeeze(1)

    def _append(self, tokens: torch.Tensor) -> torch.Tensor:
        self.last.add_(1)
        self.ids.index_copy_(1, self.last, tokens[:, None].to(self.ids.dtype))
        self.mask.index_fill_(1, self.last, True)
        return self.logits()

    def __call__(self, tokens: torch.Tensor, i: int) -> torch.Tensor:
        return self._append(tokens)

    def beams(self, tokens: torch.Tensor, beam_idx: torch.Tensor, i: int) -> torch.Tensor:
        self.ids = self.ids.index_select(0, beam_idx)
        self.mask = self.mask.index_select(0, beam_idx)
        return self._append(tokens)


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
