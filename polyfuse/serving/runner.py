"""The model side of a serving step: a scheduled batch as tensors, padded to the device's shapes, run through the
model's paged step (``DecoderForCausalLM.paged_step``) and the runtime's graphs.

A :class:`StepBatch` is built on the host (CPU tensors, picklable: under tensor parallelism rank 0 broadcasts it
and every rank runs it). Rows are prefill chunks first, then one row per decode. Shapes follow the mode:

* ``exact`` (the CPU): the batch as scheduled;
* ``graphs`` (NVIDIA with --use_cuda_graphs): a step of decodes only is padded to the next batch-size bucket (1, 2,
  4, 8, then multiples of 8) with block tables as wide as ``max_model_len`` needs, so one CUDA graph per bucket
  serves every step (runtime ``graph_module``: backends/cuda/graphs.py); steps holding a prefill chunk run eagerly;
* ``buckets`` (Gaudi): as vllm-gaudi does, prefill and decode run as separate steps, each padded to static
  buckets: sequences to a power of two, each prefill chunk to a multiple of ``bucket_size`` tokens (the rows a grid
  of sequences x chunk), block tables to a multiple of ``bucket_size`` positions. HPU graphs (--use_hpu_graphs) are
  then captured once per bucket, never per request.

Padded rows write their keys and values into the padding block 0 and attend to it alone; their logits are dropped.
A speculative sequence's verify rows (its last token and its drafts) are a prefill chunk whose every row gives logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch import nn

from polyfuse.checkpoint.config import head_dim
from polyfuse.ops.paged_attention import PagedMeta


@dataclass
class Item:
    """One scheduled sequence's rows in a step."""

    tokens: list  # the ids computed this step
    start: int  # position of the first
    table: list  # the sequence's block table
    samples: bool  # whether its last row gives logits
    verify: bool = False  # speculative decoding: every row gives logits (the drafts' and the one after them)


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    prefill: Optional[tuple]  # (block_tables, seq_lens, q_index, q_pos, out_index)
    decode: Optional[tuple]  # (block_tables, seq_lens)
    logits_rows: Optional[torch.Tensor]  # None: every decode row (a graphed decode step)
    keep: list  # which of the step's logits rows belong to sampling sequences, in order
    width: int  # block-table width (part of a graph's key)


def batch_buckets(limit: int) -> list:
    """Batch sizes CUDA graphs are captured for: 1, 2, 4, 8, then multiples of 8, up to ``limit``."""
    sizes = [s for s in (1, 2, 4) if s < limit] + list(range(8, limit, 8))
    return sizes + [limit]


def next_bucket(n: int, buckets: list) -> int:
    return next(b for b in buckets if b >= n)


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class PagedStep(nn.Module):
    """The model's paged step as a module, the unit device graphs capture. Every argument is a tensor, None, or the
    block-table width (a graph-key int), so a replay recomputes the metadata from its own buffers."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache
        self.scale = head_dim(model.config) ** -0.5

    def forward(self, width, input_ids, positions, slots, p_tables, p_lens, q_index, q_pos, out_index, d_tables,
                d_lens, logits_rows):  # fmt: skip  # size: a graph's inputs, one tensor each
        parts, n_p = [], 0
        if p_tables is not None:
            n_p = out_index.shape[0]
            parts.append((0, n_p, PagedMeta(p_tables, p_lens, q_index, q_pos, out_index, self.scale)))
        if d_tables is not None:
            parts.append((n_p, n_p + d_tables.shape[0], PagedMeta.for_decode(d_tables, d_lens, self.scale)))
        if logits_rows is None:  # a graphed decode step: every row
            logits_rows = torch.arange(n_p, input_ids.shape[0], device=input_ids.device)
        return self.model.paged_step(self.cache, input_ids, positions, slots, parts, logits_rows)


class ModelRunner:
    def __init__(self, model, cache, max_num_seqs: int, max_model_len: int, bucket_size: int = 128):
        self.model, self.cache, self.block_size = model, cache, cache.block_size
        self.device, self.runtime = model.device, model.runtime
        flags = model.flags or {}
        if flags.get("use_hpu_graphs") or self.device.type == "hpu":
            self.mode = "buckets"
        elif flags.get("use_cuda_graphs"):
            self.mode = "graphs"
        else:
            self.mode = "exact"
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // self.block_size)
        self.bucket_size = max(1, bucket_size)
        self.module = PagedStep(model, cache)
        self.prefill_step = self.runtime.graph_module(self.module, "prefill", flags)
        self.decode_step = self.runtime.graph_module(self.module, "decode", flags)

    # -- batches ---------------------------------------------------------------------------------------------------------
    def batches(self, prefills: list, decodes: list) -> list:
        """The step's :class:`StepBatch` list: one, or on Gaudi one per phase."""
        if self.mode == "buckets" and prefills and decodes:
            return [self._batch(prefills, []), self._batch([], decodes)]
        return [self._batch(prefills, decodes)]

    def _width(self, items: list) -> int:
        need = max(-(-(it.start + len(it.tokens)) // self.block_size) for it in items)
        return round_up(need, max(1, self.bucket_size // self.block_size)) if self.mode == "buckets" else need

    def _tables(self, items: list, n_seqs: int, width: int):
        """Block tables [n_seqs, width] and sequence lengths [n_seqs] (padded sequences: the padding block, one key),
        each made by one tensor call."""
        rows = [it.table[:width] + [0] * (width - min(len(it.table), width)) for it in items]
        rows += [[0] * width] * (n_seqs - len(items))
        lens = [it.start + len(it.tokens) for it in items] + [1] * (n_seqs - len(items))
        return torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)

    def _batch(self, prefills: list, decodes: list) -> StepBatch:
        bs, grid = self.block_size, self.mode == "buckets"
        ids, pos, slots, rows = [], [], [], []

        def add(item: Optional[Item], rows_taken: int):
            """The item's rows, padded to ``rows_taken`` (None: a padded sequence) with rows of the padding block."""
            n = 0 if item is None else len(item.tokens)
            for i in range(n):
                p = item.start + i
                ids.append(item.tokens[i])
                pos.append(p)
                slots.append(item.table[p // bs] * bs + p % bs)
            ids.extend([0] * (rows_taken - n))
            pos.extend([0] * (rows_taken - n))
            slots.extend([0] * (rows_taken - n))
            if item is not None and item.samples:
                last = len(ids) - rows_taken + n - 1
                rows.extend(range(last - n + 1, last + 1) if item.verify else (last,))

        p_part = d_part = None
        width = 0
        if prefills:
            q = max(len(it.tokens) for it in prefills)
            n_seqs = pow2(len(prefills)) if grid else len(prefills)
            q = round_up(q, self.bucket_size) if grid else q
            width = self._width(prefills)
            qi = torch.zeros(n_seqs, q, dtype=torch.long)
            qp = torch.zeros(n_seqs, q, dtype=torch.long)
            out = []
            for s in range(n_seqs):
                it = prefills[s] if s < len(prefills) else None
                base, n = len(ids), (len(it.tokens) if it is not None else 0)
                taken = q if grid else n
                qi[s] = torch.arange(base, base + q) if grid else base
                qi[s, :n] = torch.arange(base, base + n)
                if it is not None:
                    qp[s, :n] = torch.arange(it.start, it.start + n)
                out.extend(s * q + i for i in range(taken))
                add(it, taken)
            p_part = (*self._tables(prefills, n_seqs, width), qi, qp, torch.tensor(out, dtype=torch.long))
        graphed = self.mode == "graphs" and not prefills
        first = len(ids)
        if decodes:
            n_seqs, d_width = len(decodes), self._width(decodes)
            if graphed:
                n_seqs, d_width = next_bucket(n_seqs, self.buckets), self.max_blocks
            elif grid:
                n_seqs = pow2(n_seqs)
            for s in range(n_seqs):
                add(decodes[s] if s < len(decodes) else None, 1)
            d_part = self._tables(decodes, n_seqs, d_width)
            width = max(width, d_width)
        if graphed:  # the graph gives logits for every decode row
            keep, logits_rows = [r - first for r in rows], None
        else:
            keep, logits_rows = list(range(len(rows))), torch.tensor(rows, dtype=torch.long)
            if grid:  # a static number of logits rows too
                n_logits = pow2(max(len(rows), len(prefills) if prefills else len(decodes)))
                logits_rows = torch.cat([logits_rows, logits_rows.new_zeros(n_logits - len(rows))])
        return StepBatch(
            torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
            torch.tensor(slots, dtype=torch.long), p_part, d_part, logits_rows, keep, width,
        )  # fmt: skip

    def chain_batches(self, items: list, limits: list) -> list:
        """Multi-step decoding: the batches of ``max(limits)`` decode steps of ``items`` back to back, step i at
        position ``start + i`` of item j while ``i < limits[j]``; past it the row repeats its last position and
        writes the padding block (its logits are not used). Input ids past the first step come from the device."""
        out = []
        for i in range(max(limits)):
            step = [Item(it.tokens, it.start + min(i, r - 1), it.table, True) for it, r in zip(items, limits)]
            b = self._batch([], step)
            spent = [j for j, r in enumerate(limits) if i >= r]  # decode rows are the batch's first rows
            if spent:
                b.slots[spent] = 0
            out.append(b)
        return out

    @torch.inference_mode()
    def run_chain(self, batches: list, choose: Callable) -> list:
        """Run decode batches back to back, each step's input ids the tokens ``choose(logits)`` picked in the step
        before, on the device: no host sync between the steps. Returns each step's tokens (device tensors)."""
        out: list = []
        for b in batches:
            if out:
                prev, rows = out[-1], b.input_ids.shape[0]
                ids = prev if prev.shape[0] == rows else torch.cat([prev, prev.new_zeros(rows - prev.shape[0])])
                b = replace(b, input_ids=ids)
            out.append(choose(self.run([b])))
        return out

    def warmup(self) -> None:
        """With CUDA graphs: capture the decode step of every batch-size bucket now (all padding: only the padding
        block is written), so no request waits for a capture."""
        if self.mode != "graphs":
            return
        for n in self.buckets:
            self.run([self._batch([], [Item([0], 0, [0], False)] * n)])

    # -- running ---------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batches: list) -> torch.Tensor:
        """The logits [rows, vocab] of the step's batches, in order: one row per sampling sequence, and one per
        verified position of a speculative one."""
        out = []
        for b in batches:
            logits = self._call(b)
            if b.keep == list(range(len(b.keep))):  # a prefix of the rows (no index upload)
                out.append(logits[: len(b.keep)])
            else:
                out.append(logits.index_select(0, torch.tensor(b.keep, dtype=torch.long, device=logits.device)))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _call(self, b: StepBatch) -> torch.Tensor:
        dev = self.device

        def to(t):
            return None if t is None else t.to(dev, non_blocking=True)

        prefill = (None,) * 5 if b.prefill is None else tuple(to(t) for t in b.prefill)
        decode = (None,) * 2 if b.decode is None else tuple(to(t) for t in b.decode)
        args = (b.width, to(b.input_ids), to(b.positions), to(b.slots), *prefill, *decode, to(b.logits_rows))
        if self.mode == "exact" or (self.mode == "graphs" and b.prefill is not None):
            logits = self.module(*args)
        else:
            logits = (self.decode_step if b.prefill is None else self.prefill_step)(*args)
        self.runtime.mark_step()
        return logits
