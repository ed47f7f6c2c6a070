"""A speculative run: the prompt step, then verify steps until every row is done.

Per step: the proposer drafts k tokens; the target verifies them with its pending token (verify.py); the rule
accepts a prefix (accept.py); the rows emit their tokens (outputs.py); the proposer updates its own state
(an EAGLE-3 head runs over the verified positions); the cache slots are committed (slots.py), holes masked, and
compacted where needed. One host read-back per step (how many each row accepted), which also ends the run.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from polyfuse.generation.decoding import Decoding
from polyfuse.generation.prefill import prompt_key_mask
from polyfuse.generation.speculative.accept import TokenRule, greedy_accept, position_scores, sampled_accept
from polyfuse.generation.speculative.outputs import RowOutputs
from polyfuse.generation.speculative.proposer import Proposer
from polyfuse.generation.speculative.slots import SlotTable
from polyfuse.generation.speculative.stats import SpeculationStats
from polyfuse.generation.speculative.verify import Verifier
from polyfuse.generation.steps import prepare_cache


# Batch > 1: cache slots beyond the sequences for the holes of rows that accepted fewer (slots.py); a run that
# uses them up compacts in place (a copy of the cache's used slots, every HOLE_SLACK / mean holes a step steps).
HOLE_SLACK = 64


def _windows(model, proposer: Proposer) -> Optional[int]:
    windows = [w for w in list(getattr(model, "windows", ())) + proposer.windows() if w is not None]
    return min(windows) if windows else None


class SpeculativeRun:
    """The state proposers read: ``slots``, ``pending`` [rows] (each row's last emitted token, not yet in the
    cache, at the frontier slot), ``prev`` [rows] (the token before it), ``pos`` [rows] (the pending token's
    position), ``rule`` (the token choice), ``outputs``, ``prompts`` and ``k``."""

    def __init__(self, d: Decoding, proposer: Proposer, accept: Optional[Callable] = None):
        model, p, o = d.model, d.prompts, d.options
        self.d, self.model, self.prompts, self.proposer, self.k = d, model, p, proposer, proposer.k
        slack = 0 if p.rows == 1 else HOLE_SLACK
        prepare_cache(model, p.rows, p.total + self.k + slack, o.bucket_size)
        key_mask = torch.empty(p.rows, model.cache.max_len, dtype=torch.bool, device=p.input_ids.device)
        self.slots = SlotTable(prompt_key_mask(p, key_mask), p.n, o.bucket_size, _windows(model, proposer))
        proposer.reserve(p.rows, self.slots.max_len)
        self.rule = TokenRule(o, d.generator)
        self.verifier = Verifier(model, proposer.hidden_layers)
        self.outputs = RowOutputs(d, model.config.vocab_size)
        self.stats = SpeculationStats(proposer.name, self.k)
        self.accept = accept or (sampled_accept if o.do_sample else greedy_accept)

    def caches(self) -> list:
        return [self.model.cache, *self.proposer.caches()]

    def prompt_step(self) -> None:
        p, o = self.prompts, self.d.options
        position_ids = p.position_ids()
        self.d.start()
        logits, hidden = self.verifier.prompt(self.model, p, position_ids, self.slots.key_mask)
        scores = position_scores(logits[:, None], self.outputs.seen, logits.new_zeros(p.rows, 0).long(), o.penalty)
        first, _ = self.rule.choose(scores[:, 0])
        self.pending, self.prev, self.pos = first, p.input_ids[:, -1], position_ids[:, -1] + 1
        self.outputs.first(first)
        if self.outputs.seen is not None:
            self.outputs.mark_seen(torch.zeros_like(first), first[:, None])
        self.d.boundary(0)
        self.proposer.start(self, hidden)

    def step(self) -> None:
        proposal = self.proposer.propose(self)
        drafts = proposal.tokens if proposal is not None else self.pending.new_zeros(self.prompts.rows, 0)
        logits, hidden = self.verifier(self, drafts)
        scores = position_scores(logits, self.outputs.seen, drafts, self.d.options.penalty)
        accepted, emitted = self.accept(scores, proposal, self.rule)
        if proposal is not None:
            self.proposer.accepted(self, proposal, accepted, emitted, hidden)
        running = self.outputs.running()
        a_host = accepted.tolist()  # the step's one read-back
        kept = self.outputs.add(a_host, emitted.tolist())
        self.outputs.mark_seen(accepted, emitted)
        self.stats.add(running, a_host, emitted.shape[1], kept)
        at = accepted[:, None]
        before = emitted.gather(1, (at - 1).clamp(min=0))[:, 0]
        self.prev = torch.where(accepted > 0, before, self.pending)
        self.pending, self.pos = emitted.gather(1, at)[:, 0], self.pos + accepted + 1
        counts = [a for a, r in zip(a_host, running) if r]
        most = max(counts, default=0)
        self.slots.commit(accepted, any(a < most for a in counts), most)
        if self.slots.must_compact(self.k + 1) and not self.outputs.all_done():
            finished = torch.tensor([not r for r in self.outputs.running()], device=accepted.device)
            self.slots.compact(self.caches(), finished)
            if not self.slots.room(self.k + 1):
                raise RuntimeError("speculative decoding: the KV cache has no room left after compaction")

    def run(self) -> torch.Tensor:
        self.prompt_step()
        while not self.outputs.all_done():
            self.step()
            self.d.boundary(1)
        self.stats.compactions = self.slots.compactions
        if self.d.hooks is not None:
            self.d.hooks.speculation(self.stats)
        p = self.prompts
        return self.d.result(self.outputs.result(p.input_ids.dtype, p.input_ids.device))


def speculative_decode(d: Decoding, proposer: Proposer, accept: Optional[Callable] = None) -> torch.Tensor:
    """Prompts + new tokens, drafted by ``proposer`` and verified by ``d.model``. ``accept(scores, proposal, rule)``
    replaces the acceptance rule (benchmarks replay a fixed acceptance)."""
    return SpeculativeRun(d, proposer, accept).run()
