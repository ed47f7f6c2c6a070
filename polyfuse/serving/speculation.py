"""Speculative decoding in the serving engine (``--speculative_method prompt_lookup``; docs/serving.md).

Before a step, each decoding sequence may get drafts: prompt lookup over its prompt and output so far (the
generation engine's n-gram matcher, generation/speculative/prompt_lookup.py), at most k and never more than its
``max_tokens`` and ``max_model_len`` leave room for. The step computes [last token, d_1 .. d_j] as one chunk of
the paged step, every row giving logits, and the sequence accepts by the standard rule (the generation engine's,
generation/speculative/accept.py): greedy, the drafts equal to the target's argmax from the first on, then the
target's own next token; sampling, d_i accepted with probability p_i(d_i) (the drafts are deterministic: q is
one-hot), the first rejection replaced by a draw from max(0, p_i - q_i) renormalized, and after j acceptances a
draw from p_{j+1}, so the tokens are distributed as the target's. p is the request's own distribution
(temperature, top-k, top-p). The engine then rolls the cache back past the rejected drafts (scheduler.rollback).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from polyfuse.generation.speculative.accept import TokenRule, sampled_accept
from polyfuse.generation.speculative.prompt_lookup import lookup
from polyfuse.generation.speculative.proposer import Proposal
from polyfuse.serving.request import Sequence
from polyfuse.serving.sampling import draw_tokens, token_logprobs


@dataclass
class SpecStats:
    """Counted over every decode step of a sequence while speculation is on (with drafts or without)."""

    decode_steps: int = 0  # sequence x step
    draft_steps: int = 0  # of those, with drafts
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a decoding sequence gains per step: its accepted drafts + the target's own next token."""
        return (self.accepted + self.decode_steps) / self.decode_steps if self.decode_steps else 0.0


class PromptLookupDrafter:
    """The scheduler's ``propose``: prompt lookup's drafts for one decoding sequence."""

    def __init__(self, setting, eos: set, max_model_len: int):
        self.k, self.ngram, self.eos, self.max_model_len = setting.k, setting.ngram, set(eos), max_model_len

    def __call__(self, seq: Sequence, budget: int) -> list:
        p = seq.params
        room = min(self.k, budget, p.max_tokens - len(seq.output) - 1, self.max_model_len - seq.num_tokens - 1)
        if room < 1:
            return []
        eos = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos)
        return lookup(torch.tensor(seq.tokens), room, self.ngram, eos)


def _rule(params, generator) -> TokenRule:
    options = SimpleNamespace(do_sample=True, penalty=None, temperature=params.temperature,
                              top_k=params.top_k or None, top_p=params.top_p)  # fmt: skip
    return TokenRule(options, generator)


def _accept_greedy(g: list, drafts: list) -> list:
    """The target's argmax ``g`` over [last, d_1 .. d_j]: the tokens emitted (accepted drafts + one)."""
    a = 0
    while a < len(drafts) and drafts[a] == g[a]:
        a += 1
    return g[: a + 1]


def _accept_sampled(logits: torch.Tensor, group: list, drafts: list, params, generator) -> list:
    """Emitted tokens of the sequences ``group`` (same parameters, same number of drafts, one generator) whose
    verify rows are ``logits`` [len(group) x (j + 1), V]."""
    width = len(drafts[group[0]]) + 1
    scores = logits.float().view(len(group), width, -1)
    tokens = torch.tensor([drafts[i] for i in group], dtype=torch.int64, device=logits.device)
    accepted, emitted = sampled_accept(scores, Proposal(tokens), _rule(params, generator))
    return [row[: a + 1] for row, a in zip(emitted.tolist(), accepted.tolist())]


def _by_rows(idx: list, starts: list, widths: list, device) -> torch.Tensor:
    """The logits rows of the sequences ``idx``, in order."""
    return torch.tensor([starts[i] + j for i in idx for j in range(widths[i])], dtype=torch.long, device=device)


def choose(logits: torch.Tensor, seqs: list, drafts: list, generator: Optional[torch.Generator] = None):
    """(emitted tokens [list of lists], logprobs [list of None or per-token lists]) for ``seqs``, whose rows in
    ``logits`` are one each, or ``1 + len(drafts[i])`` where sequence i verifies drafts."""
    widths = [1 + len(d) for d in drafts]
    starts = [sum(widths[:i]) for i in range(len(widths))]
    device = logits.device
    emitted: list = [None] * len(seqs)
    if all(s.params.greedy for s in seqs):
        g = logits.argmax(-1).tolist()  # one sync for every greedy row
        emitted = [_accept_greedy(g[starts[i] : starts[i] + widths[i]], drafts[i]) for i in range(len(seqs))]
    else:
        plain = [i for i in range(len(seqs)) if not drafts[i]]
        if plain:
            rows = _by_rows(plain, starts, widths, device)
            tokens = draw_tokens(logits.index_select(0, rows), [seqs[i] for i in plain], generator).tolist()
            for i, t in zip(plain, tokens):
                emitted[i] = [t]
        groups: dict = {}
        for i in range(len(seqs)):
            if drafts[i]:
                p, own = seqs[i].params, seqs[i].generator
                key = ("greedy",) if p.greedy else (p.temperature, p.top_k, p.top_p, widths[i], own is None)
                groups.setdefault(key if own is None else (*key, i), []).append(i)
        for key, group in groups.items():
            part = logits.index_select(0, _by_rows(group, starts, widths, device))
            if key == ("greedy",):
                g, at = part.argmax(-1).tolist(), 0
                for i in group:
                    emitted[i] = _accept_greedy(g[at : at + widths[i]], drafts[i])
                    at += widths[i]
                continue
            own = seqs[group[0]].generator
            for i, e in zip(group, _accept_sampled(part, group, drafts, seqs[group[0]].params, own or generator)):
                emitted[i] = e
    return emitted, _logprobs(logits, seqs, emitted, starts)


def _logprobs(logits: torch.Tensor, seqs: list, emitted: list, starts: list) -> list:
    """Each emitted token's log-probability under the raw logits of the row that chose it."""
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list = [None] * len(seqs)
    if not wanted:
        return out
    rows = [starts[i] + j for i in wanted for j in range(len(emitted[i]))]
    tokens = [t for i in wanted for t in emitted[i]]
    tops = [seqs[i].params.logprobs for i in wanted for _ in emitted[i]]
    picked = token_logprobs(logits.index_select(0, torch.tensor(rows, device=logits.device)),
                            torch.tensor(tokens), tops)  # fmt: skip
    at = 0
    for i in wanted:
        out[i] = picked[at : at + len(emitted[i])]
        at += len(emitted[i])
    return out
