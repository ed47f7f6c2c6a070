"""--simulate_dyn_prompt L1 L2 ...: optimum-habana's dynamic-prompt simulation. Every batch's prompt columns are cut
to, or stretched to, each length in turn (its ``adjust_batch``: the first L columns kept; or the last column repeated
to L); the warm-up runs the prompt lengths the timed runs will use, then each timed run takes the next length of the
list, cycling.

Warm-up, as optimum-habana's: one length given (or the same one repeated), --warmup runs of it; several, and
--bucket_size > 0, --warmup passes over every bucket between the shortest's and the longest's (each at its bucket's
last length, bucket - 1); several without buckets, no warm-up (every length is its own shape). The buckets run
longest first, unlike optimum-habana's ascending order: polyfuse keeps one KV cache for a batch shape and grows it
only when a longer run needs more, so the longest bucket allocates it once and every shorter bucket is compiled for
the cache it runs on afterwards (ascending, each longer bucket would reallocate it and invalidate the graphs before).
"""

from __future__ import annotations

import itertools

import torch


def adjust_batch(ids: torch.Tensor, mask: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` with ``size`` columns: the first ``size`` when there are as many, else the last column
    repeated up to ``size`` (optimum-habana's adjust_batch)."""
    n = ids.shape[1]
    if n >= size:
        return ids[:, :size], mask[:, :size]
    more = size - n
    return torch.cat([ids, ids[:, -1:].expand(-1, more)], 1), torch.cat([mask, mask[:, -1:].expand(-1, more)], 1)


def check_lengths(lengths) -> None:
    """ValueError (one line) for lengths that cannot be prompts."""
    if lengths is not None and (not lengths or any(n < 1 for n in lengths)):
        raise ValueError(f"--simulate_dyn_prompt: give prompt lengths >= 1, got {lengths or 'none'}")


def warmup_plan(lengths, warmup: int, bucket_size: int) -> list:
    """``[(line printed, prompt length or None)]`` of the warm-up runs."""
    if lengths is None:
        return [(f"Warming up iteration {i + 1}/{warmup}", None) for i in range(warmup)]
    if len(set(lengths)) == 1:
        return [(f"Warming up for shape {lengths[0]} iteration {i + 1}/{warmup}", lengths[0]) for i in range(warmup)]
    if bucket_size <= 0:
        return []
    lo, hi = (-(-n // bucket_size) * bucket_size for n in (min(lengths), max(lengths)))
    sizes = list(range(hi, lo - 1, -bucket_size))  # longest first (see the module's docstring)
    return [(f"Warming up for shape {s - 1} iteration {i + 1}/{warmup}", s - 1) for i in range(warmup) for s in sizes]


def timed_lengths(lengths, n_iterations: int) -> list:
    """The prompt length of each timed run (None: the prompts as they are)."""
    if lengths is None:
        return [None] * n_iterations
    return list(itertools.islice(itertools.cycle(lengths), n_iterations))
