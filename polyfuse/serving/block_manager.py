"""KV blocks: fixed-size pieces of the paged cache, per-sequence block tables, reference counts, prefix caching.

* A sequence's block table lists the blocks holding its positions in order (position p: table[p // block_size] at
  offset p % block_size). Blocks are taken as the sequence grows and all given back the moment it ends.
* Prefix caching: a *full* block of a prompt, once its keys and values are computed, is registered under the hash
  of its tokens chained with the hash of the blocks before it (so equal hashes mean equal whole prefixes; the
  tokens are kept and compared too, so a hash collision never shares a wrong block). A new sequence whose prompt
  starts with registered blocks takes them (reference count + 1) and computes only the rest. At most the prompt's
  first ``len - 1`` tokens come from the cache: the last prompt token is always computed, for its logits.
* A block whose count drops to 0 goes back to the free queue but keeps its contents and hash: it is handed out
  again (its hash dropped) only when the least recently freed blocks before it are gone, so a prompt served a while
  ago still hits. Block 0 is the padding block (kv_cache.py) and is never handed out.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self.free: OrderedDict = OrderedDict((b, None) for b in range(1, num_blocks))  # oldest first
        self.hash_of: dict = {}  # block -> its prefix hash (registered blocks only)
        self.cached: dict = {}  # prefix hash -> (block, the block's tokens)
        self.tables: dict = {}  # sequence id -> [block, ...]
        self.hashes: dict = {}  # sequence id -> prefix hashes of its registered prompt blocks, in order
        self.hit_tokens = self.queried_tokens = 0

    # -- sizes ---------------------------------------------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.usable_blocks - len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def table(self, seq_id) -> list:
        return self.tables.get(seq_id, [])

    # -- prefix caching --------------------------------------------------------------------------------------------------
    @staticmethod
    def chain_hash(parent: Optional[int], tokens: Sequence[int]) -> int:
        return hash((parent, tuple(tokens)))

    def cached_prefix(self, tokens: Sequence[int]) -> list:
        """The registered blocks holding the longest prefix of ``tokens`` (whole blocks, at most len - 1 tokens)."""
        if not self.prefix_caching:
            return []
        bs, parent, blocks = self.block_size, None, []
        for i in range((len(tokens) - 1) // bs):
            part = tuple(tokens[i * bs : (i + 1) * bs])
            h = self.chain_hash(parent, part)
            entry = self.cached.get(h)
            if entry is None or entry[1] != part:
                break
            blocks.append(entry[0])
            parent = h
        return blocks

    def register_prompt_blocks(self, seq_id, prompt: Sequence[int], computed: int) -> None:
        """Register the full prompt blocks of ``seq_id`` whose keys and values are now computed (``computed``
        tokens). A block whose prefix another block already holds stays private (the other keeps the entry)."""
        if not self.prefix_caching:
            return
        table, hashes, bs = self.tables.get(seq_id, []), self.hashes.setdefault(seq_id, []), self.block_size
        full = min(computed, len(prompt)) // bs
        for i in range(len(hashes), min(full, len(table))):
            part = tuple(prompt[i * bs : (i + 1) * bs])
            h = self.chain_hash(hashes[-1] if hashes else None, part)
            hashes.append(h)
            block = table[i]
            if h not in self.cached and block not in self.hash_of:
                self.cached[h] = (block, part)
                self.hash_of[block] = h

    # -- allocation ------------------------------------------------------------------------------------------------------
    def can_take(self, new_blocks: int, reused: Sequence[int] = (), watermark: int = 0) -> bool:
        """Whether ``new_blocks`` fresh blocks plus the cached ``reused`` ones fit, leaving ``watermark`` free."""
        from_free = sum(1 for b in reused if self.refs[b] == 0)
        return new_blocks + from_free + watermark <= len(self.free)

    def adopt(self, seq_id, blocks: Sequence[int]) -> None:
        """Start ``seq_id``'s table with cached ``blocks`` (its prompt's prefix)."""
        table = self.tables.setdefault(seq_id, [])
        assert not table, "a prefix is adopted by a sequence that has no blocks yet"
        for b in blocks:
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1
            table.append(b)

    def count_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def grow(self, seq_id, tokens: int) -> bool:
        """Give ``seq_id`` blocks for ``tokens`` positions in all; False (nothing taken) when too few are free."""
        table = self.tables.setdefault(seq_id, [])
        need = self.blocks_for(tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            block, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(block, None)
            if h is not None:
                del self.cached[h]  # evicted: its contents are about to be overwritten
            self.refs[block] = 1
            table.append(block)
        return True

    def shrink(self, seq_id, tokens: int) -> None:
        """Drop the blocks of ``seq_id`` past its first ``tokens`` positions (speculative decoding's rollback: they
        hold only rejected drafts). Nothing is copied; such a block is reused before any other free block."""
        table = self.tables.get(seq_id, [])
        keep = self.blocks_for(tokens)
        while len(table) > keep:
            block = table.pop()
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None
                self.free.move_to_end(block, last=False)

    def release(self, seq_id) -> None:
        """Give back every block of ``seq_id`` (shared ones when their last user is gone)."""
        self.hashes.pop(seq_id, None)
        for block in reversed(self.tables.pop(seq_id, [])):  # the prefix's blocks end up most recently freed
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def slot(self, seq_id, position: int) -> int:
        table = self.tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size
