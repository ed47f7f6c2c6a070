"""The KV-cache slots of a speculative run, shared by every cache in it (the target's, a draft model's, an EAGLE-3
head's): one frontier for all rows and one key mask.

The static cache is written in place at ``cache_position``, one slot index for every row. The pending token of each
row (chosen, not yet in the cache) goes to the frontier slot ``c``; a verify step writes slots ``c .. c + k``. Row r
accepts ``a_r`` drafts: its slots ``c .. c + a_r`` hold its sequence, and the frontier moves to ``c + A + 1`` with
``A`` the most any running row accepted. Nothing is copied: the rejected slots of the row(s) that accepted ``A`` are
overwritten by the next step; in a batch, a row that accepted fewer keeps slots ``c + a_r + 1 .. c + A`` as holes,
False in the key mask, which every step's attention reads (the rope positions are each row's own, so holes change
nothing). At batch 1 there are never holes.

Holes cost cache room and attended length. When the next step would not fit, or where a sliding window counts
slots (holes would shorten it) and the run is past the window, :meth:`compact` moves each row's slots up against
the frontier (right-aligned, as left padding is), in place in every cache of the run: graphs captured on the caches
stay valid.
"""

from __future__ import annotations

from typing import Optional

import torch

from polyfuse.generation.kv_cache import kv_len_at


class SlotTable:
    def __init__(self, key_mask: torch.Tensor, frontier: int, bucket_size: int, window: Optional[int] = None):
        self.key_mask, self.frontier, self.bucket_size, self.window = key_mask, frontier, bucket_size, window
        self.max_len = key_mask.shape[1]
        self.holes = False
        self.compactions = 0

    def positions(self, width: int, offset: int = 0) -> torch.Tensor:
        """Cache slots [width] from the frontier (plus ``offset``)."""
        start = self.frontier + offset
        return torch.arange(start, start + width, device=self.key_mask.device)

    def kv_len(self, last_slot: int) -> int:
        """The KV length a step whose last query is at ``last_slot`` attends (bucketed as generate() does)."""
        return kv_len_at(last_slot, self.bucket_size, self.max_len)

    def room(self, width: int) -> bool:
        return self.frontier + width <= self.max_len

    def commit(self, accepted: torch.Tensor, fewer: bool, most: int) -> None:
        """Row r keeps slots up to frontier + accepted[r]; the frontier moves past ``most`` + 1 of them. ``fewer``:
        some running row accepted less than ``most`` (it now has holes; known on the host, so no sync here)."""
        c = self.frontier
        if most > 0 and accepted.shape[0] > 1:
            span = torch.arange(most + 1, device=accepted.device)
            self.key_mask[:, c : c + most + 1] = span[None] <= accepted[:, None]
        self.holes = self.holes or fewer
        self.frontier = c + most + 1

    def must_compact(self, width: int) -> bool:
        """The next step of ``width`` slots does not fit, or holes would shorten a sliding window it reaches."""
        if not self.room(width):
            return True
        return self.holes and self.window is not None and self.frontier + width > self.window

    def compact(self, caches: list, keep_one: Optional[torch.Tensor] = None) -> None:
        """Move every row's slots before the frontier to end at ``frontier - 1`` (right-aligned), in every cache of
        ``caches``; the frontier becomes the longest row's count. ``keep_one`` [rows] bool: rows whose sequence is no
        longer needed (finished), kept as their last slot only."""
        c = self.frontier
        valid = self.key_mask[:, :c].clone()
        if keep_one is not None and bool(keep_one.any()):
            last = torch.zeros_like(valid)
            last[:, c - 1] = True
            valid = torch.where(keep_one[:, None], last, valid)
        counts = valid.sum(dim=1).tolist()
        new = max(counts)
        for r, n in enumerate(counts):
            src = valid[r].nonzero()[:, 0]
            dst = torch.arange(new - n, new, device=src.device)
            if torch.equal(src, dst):
                continue
            for cache in caches:
                for t in cache.k + cache.v:
                    t[r, :, dst] = t[r, :, src]  # the source rows are gathered first, then written
        self.key_mask.fill_(True)
        for r, n in enumerate(counts):
            self.key_mask[r, : new - n] = False
        self.frontier, self.holes = new, False
        self.compactions += 1
