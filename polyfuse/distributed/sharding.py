"""How a tensor-parallel rank splits a decoder layer: attention heads, MLP columns and the vocabulary.

Megatron's layout, as the registry sees it (every matmul is still the ``linear`` / ``swiglu_linear`` op on local
weights; the only new op is ``all_reduce``):

* **fused QKV, column-parallel**: rank r computes its query heads and the key/value heads those queries read;
* **gate/up, column-parallel**: rank r holds a contiguous block of the intermediate columns;
* **o_proj and down_proj, row-parallel**: each rank multiplies its slice of the inputs by the matching input
  columns and one ``all_reduce`` sums the partial outputs (two per layer); a row-parallel bias is added by rank 0
  only (the others hold zeros), so the sum counts it once;
* **LM head, vocab-parallel**: rank r computes the logits of its vocabulary rows; they are zero-padded to the full
  vocabulary and summed by the same ``all_reduce`` op (one more per step), so every rank ends with identical full
  logits (sampling and the in-graph greedy step run unchanged). Why: the head is read whole every token, so a
  replicated head costs every rank the full head's bandwidth (Llama-3-8B at TP=2: +1.05 GB per token per rank,
  about 7% of a step) and memory (70B: 2.1 GB per rank with Llama-3's vocabulary);
* **embedding, replicated**: a lookup reads only the batch's rows, so replicating it costs memory only (Llama-3-70B:
  2.1 GB per rank) while a vocab-parallel embedding would add one all-reduce per step. A tied LM head is a view of
  the rank's rows of the replicated embedding: no second copy.

Splits are contiguous and balanced: with ``n`` items over ``w`` ranks the first ``n % w`` ranks take one more, so
uneven counts split too (SmolLM2-135M's 9 heads over 2 ranks: 5 and 4). Key/value heads: rank r keeps, for each
block of its query heads that reads one kv head, that kv head, so every rank runs ordinary grouped-query attention
on its own heads:

* ``num_key_value_heads % world_size == 0`` (and the query heads divide too): kv heads are split (Llama-3-8B and
  70B at TP=2, 4, 8: one or more whole kv heads per rank);
* ``world_size % num_key_value_heads == 0``: each rank keeps the one kv head of its queries (replicated over
  ``world_size / num_key_value_heads`` ranks, as vLLM does);
* otherwise (the groups straddle ranks): a rank keeps a copy of its kv heads per block of queries, down to one
  kv head per query head (SmolLM2 at TP=2: 5 and 4 kv heads instead of 3). Correct everywhere, at the price of a
  larger KV cache and k/v projection on each rank.

A world size the model cannot split (more ranks than attention heads or intermediate columns) raises
:class:`TensorParallelError` when the model is built, on every rank alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class TensorParallelError(ValueError):
    """The model cannot run at this world size (raised identically on every rank, before any collective)."""


def split(n: int, world_size: int, rank: int) -> range:
    """Rank ``rank``'s contiguous block of ``n`` items; the first ``n % world_size`` ranks take one more."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@dataclass(frozen=True)
class HeadShard:
    q: range  # global query heads of this rank
    kv: tuple  # global kv head of each local kv head (repeats where groups straddle ranks)


def head_shard(n_heads: int, n_kv: int, world_size: int, rank: int) -> HeadShard:
    """The query heads of ``rank`` and the kv heads they read, laid out for ordinary GQA on the rank."""
    if world_size == 1:
        return HeadShard(range(n_heads), tuple(range(n_kv)))
    if world_size > n_heads:
        raise TensorParallelError(
            f"world size {world_size} cannot split this model: {n_heads} attention head(s) over {world_size} ranks "
            "(each rank needs at least one head; docs/distributed.md)"
        )
    if n_heads % n_kv:
        raise TensorParallelError(f"{n_heads} attention heads do not form groups over {n_kv} key/value heads")
    q = split(n_heads, world_size, rank)
    group = n_heads // n_kv
    # Blocks of consecutive local query heads that read one kv head each: gcd(local heads, group) when the heads
    # split evenly (every rank the same shapes), else the largest block that stays inside one group on this rank.
    if n_heads % world_size == 0:
        block = math.gcd(len(q), group)
    else:
        block = next(
            b
            for b in range(len(q), 0, -1)
            if len(q) % b == 0 and all(q[i] // group == q[i + b - 1] // group for i in range(0, len(q), b))
        )
    return HeadShard(q, tuple(q[i] // group for i in range(0, len(q), block)))


def check_columns(name: str, n: int, world_size: int) -> None:
    if world_size > n:
        raise TensorParallelError(
            f"world size {world_size} cannot split this model: {name} {n} over {world_size} ranks"
        )


@dataclass(frozen=True)
class Shard:
    """What one rank reads of one checkpoint tensor: ``blocks`` ([start, stop) ranges, concatenated in order) along
    ``dim`` (0: output rows of a column-parallel weight; 1: input columns of a row-parallel weight), whose full
    length is ``size``. A 1-D tensor (a bias) with ``dim`` 1 belongs to a row-parallel layer: rank 0 reads it
    whole, the other ranks hold zeros."""

    dim: int
    blocks: tuple
    size: int

    @staticmethod
    def of(dim: int, items, width: int, size: int) -> "Shard":
        """The rows (or columns) of ``items`` (head or column indices, each ``width`` wide), runs merged."""
        blocks: list = []
        for i in items:
            start, stop = i * width, (i + 1) * width
            if blocks and blocks[-1][1] == start:
                blocks[-1] = (blocks[-1][0], stop)
            else:
                blocks.append((start, stop))
        return Shard(dim, tuple(blocks), size * width)
