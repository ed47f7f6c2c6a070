"""The in-place greedy token's state: persistent device buffers kept per KV cache, and the argmax + EOS
bookkeeping that runs inside the graphed :class:`polyfuse.generation.steps.TokenStep`."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def is_eos(ids: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    # A broadcast compare rather than torch.isin, which may sort (and sync) for larger inputs: no graph holds that.
    return (ids[..., None] == eos).any(-1)


def greedy_token(logits, finished, eos: Optional[torch.Tensor], pad_token_id: int) -> torch.Tensor:
    """argmax token [B]; with EOS ids, rows already finished get ``pad_token_id`` and ``finished`` is updated in
    place with the rows that emit an EOS id now (what the per-token loop does with sampled tokens)."""
    tok = logits.argmax(dim=-1)
    if eos is not None:
        tok = tok.masked_fill(finished, pad_token_id)
        finished.logical_or_(is_eos(tok, eos))
    return tok


class TokenState:
    """The buffers :class:`TokenStep` reads and updates, one set per KV cache: graphs capture their addresses, so
    they live as long as the cache and every generate() on that cache reuses them (and the graphs)."""

    def __init__(self, batch: int, max_len: int, device):
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)
        self.key_mask = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.history = torch.zeros(batch, max_len, dtype=torch.long, device=device)  # column c: token at position c
        self._eos: dict = {}
        self._seen: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, cache) -> "TokenState":
        """The cache's state, made on first use."""
        if cache.token_state is None:
            cache.token_state = cls(cache.batch, cache.max_len, cache.device)
        return cache.token_state

    def seen(self, vocab: int) -> torch.Tensor:
        """The repetition penalty's seen-ids mask [batch, vocab], allocated on first use and kept (graphs hold it)."""
        if self._seen is None or self._seen.shape[1] != vocab:
            self._seen = torch.zeros(self.history.shape[0], vocab, dtype=torch.bool, device=self.history.device)
        return self._seen

    def eos(self, ids: Sequence[int]) -> Optional[torch.Tensor]:
        """The EOS ids as a device tensor, the same one for the same ids (a new one would mean a new capture)."""
        if not ids:
            return None
        if tuple(ids) not in self._eos:
            self._eos[tuple(ids)] = torch.tensor(ids, device=self.history.device)
        return self._eos[tuple(ids)]

    def args(self) -> tuple:
        """TokenStep's tensor arguments after ``kv_len``, in its order."""
        return self.tok, self.pos, self.cache_position, self.key_mask, self.finished, self.history
