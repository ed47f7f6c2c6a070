"""Iteration-level scheduling: which sequences run in the next step, and how many of their tokens.

Every step (vLLM's scheduler design, our code):

1. The running sequences, oldest first, each get their next tokens: one for a decode, the rest of the prompt (or
   of a recompute) for a prefill, cut to what is left of the step's token budget (``max_num_batched_tokens``):
   chunked prefill, so a long prompt is spread over steps and the decodes in the same batch keep going every step.
   A sequence whose next tokens need a block when none is free takes one from the newest running sequence, which is
   preempted: its blocks are freed and it goes back to the front of the queue to be recomputed (prompt and output so
   far) once blocks are free again; a request never fails for want of KV memory.
2. Then waiting sequences are admitted in arrival order while the budget, ``max_num_seqs`` and the free blocks
   (beyond a small watermark) allow, each taking the cached blocks of its prompt's prefix first. A choice of an
   ``n > 1`` request waits while a sibling is still prefilling, so it finds the shared prompt in the prefix cache.
   Nothing is admitted in a step that had to preempt.

With speculative decoding (speculation.py) a decoding sequence's step also carries the tokens its proposer drafts:
they take budget and blocks like prefill tokens, and are dropped (a plain decode) when either is short. After the
step, :meth:`Scheduler.rollback` keeps what was accepted and gives back the blocks only rejected drafts filled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from polyfuse.serving.block_manager import BlockManager
from polyfuse.serving.request import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    start: int  # first position computed this step
    count: int  # tokens computed this step, drafts included
    drafts: list = field(default_factory=list)  # speculative decoding: drafted tokens after the sequence's last

    @property
    def samples(self) -> bool:
        """Whether this step gives the sequence a new token (its last prompt or output token is computed)."""
        return self.start + self.count - len(self.drafts) == self.seq.num_tokens

    def tokens(self) -> list:
        """The ids this step computes: the sequence's own, then its drafts."""
        return self.seq.token_slice(self.start, self.count - len(self.drafts)) + self.drafts


@dataclass
class StepPlan:
    prefills: list = field(default_factory=list)  # [Scheduled] with count > 1 (prefill chunks, verified drafts)
    decodes: list = field(default_factory=list)  # [Scheduled] with count == 1
    preempted: list = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.count for s in self.prefills) + len(self.decodes)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, watermark: float = 0.01,
                 propose: Optional[Callable] = None):  # fmt: skip
        self.blocks = blocks
        self.propose = propose  # (sequence, token budget) -> drafts to verify after its next token
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.watermark = max(1, int(watermark * blocks.usable_blocks)) if blocks.usable_blocks > 8 else 0
        self.waiting: deque = deque()
        self.running: list = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (finished or aborted): its blocks go back at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.blocks.release(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.seq_id)
        seq.status, seq.computed = Status.WAITING, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> StepPlan:
        plan, budget = StepPlan(), self.budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            count = min(seq.num_tokens - seq.computed, budget)
            drafts = self._drafts(seq, count, budget)
            if drafts:
                count += len(drafts)
                plan.prefills.append(Scheduled(seq, seq.computed, count, drafts))
                budget -= count
                i += 1
                continue
            while not self.blocks.grow(seq.seq_id, seq.computed + count):
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it preempted itself: every sequence after it is gone too
            (plan.decodes if count == 1 else plan.prefills).append(Scheduled(seq, seq.computed, count))
            budget -= count
            i += 1
        if not plan.preempted:
            self._admit(plan, budget)
        return plan

    def _drafts(self, seq: Sequence, count: int, budget: int) -> list:
        """A decoding sequence's drafts, if the budget and the free blocks (beyond the watermark) take them."""
        if self.propose is None or count != 1 or seq.num_tokens - seq.computed != 1 or seq.computed < len(seq.prompt):
            return []  # a decode's only: not the prompt's last token
        drafts = self.propose(seq, budget - 1)
        if not drafts:
            return []
        table = self.blocks.table(seq.seq_id)
        new = self.blocks.blocks_for(seq.computed + 1 + len(drafts)) - len(table)
        if new > 0 and not self.blocks.can_take(new, (), self.watermark):
            return []  # no room: a plain decode, which may still preempt to get its block
        self.blocks.grow(seq.seq_id, seq.computed + 1 + len(drafts))
        return drafts

    def _admit(self, plan: StepPlan, budget: int) -> None:
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if any(s.status is Status.RUNNING and s.prefilling for s in seq.siblings):
                deferred.append(self.waiting.popleft())  # its prompt blocks will be in the cache in a moment
                continue
            prefix = self.blocks.cached_prefix(seq.tokens) if seq.computed == 0 else []
            start = len(prefix) * self.blocks.block_size
            count = min(seq.num_tokens - start, budget)
            new = self.blocks.blocks_for(start + count) - len(prefix)
            if not self.blocks.can_take(new, prefix, self.watermark if self.running else 0):
                break
            self.waiting.popleft()
            self.blocks.adopt(seq.seq_id, prefix)
            self.blocks.grow(seq.seq_id, start + count)
            if seq.preemptions == 0:
                self.blocks.count_query(len(seq.prompt), start)
                seq.cached_tokens = start
            seq.computed, seq.status = start, Status.RUNNING
            self.running.append(seq)
            (plan.decodes if count == 1 else plan.prefills).append(Scheduled(seq, start, count))
            budget -= count
        self.waiting.extendleft(reversed(deferred))

    def computed(self, plan: StepPlan) -> None:
        """After the step ran: what it computed is in the cache (full prompt blocks are registered for sharing)."""
        for s in plan.prefills + plan.decodes:
            s.seq.computed = s.start + s.count
            self.blocks.register_prompt_blocks(s.seq.seq_id, s.seq.prompt, s.seq.computed)

    def rollback(self, seq: Sequence, computed: int) -> None:
        """Speculative decoding: only ``computed`` positions of ``seq`` hold accepted tokens. The keys and values
        past them stay where they are, to be overwritten; blocks holding none of the accepted ones are freed."""
        seq.computed = computed
        self.blocks.shrink(seq.seq_id, computed)
