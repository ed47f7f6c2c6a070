"""A draft model (transformers' and optimum-habana's ``assistant_model``): a smaller causal LM of the same tokenizer
drafts k tokens one decode step at a time, through its own KV cache and its own (graphed) steps.

The draft's cache follows the run's slots (slots.py): same frontier, same key mask, same compaction. After a verify
step its slots up to each row's accepted length hold the right keys, except the last accepted draft of a row that
accepted all k, which the draft never fed. So each round starts with a two-token step, [previous token, pending
token] at slots [c - 1, c]: it writes that missing entry (and rewrites an existing one, or a hole, in the other
rows), then k - 1 one-token steps. Drafting is greedy at temperature 0; when sampling, each draft is drawn from the
draft's distribution under the same warpers, which the acceptance rule reads.
"""

from __future__ import annotations

from typing import Optional

import torch

from polyfuse.generation.cached_step import CachedStep
from polyfuse.generation.speculative.proposer import Proposal, Proposer
from polyfuse.generation.speculative.verify import step_positions
from polyfuse.generation.steps import prepare_cache


def check_draft(draft, target) -> None:
    """One-line ValueErrors for a draft model that cannot draft for ``target``."""
    if not callable(getattr(draft, "step", None)) or getattr(draft, "config", None) is None:
        raise ValueError(f"assistant_model must be a polyfuse model (from_pretrained), got {type(draft).__name__}")
    if draft is target:
        raise ValueError("assistant_model is the model itself: a draft model must be a second (smaller) model")
    ours, theirs = target.config.vocab_size, draft.config.vocab_size
    if ours != theirs:
        raise ValueError(
            f"assistant_model's vocabulary has {theirs} tokens, the model's {ours}: a draft model must share the "
            "model's tokenizer"
        )
    if draft.device != target.device:
        raise ValueError(
            f"assistant_model is on {draft.device}, the model on {target.device}: load both on one device"
        )


class DraftModel(Proposer):
    name = "draft"

    def __init__(self, draft, target, k: int):
        check_draft(draft, target)
        super().__init__(k)
        self.draft = draft
        self.limit = min(draft.config.max_position_embeddings, target.config.max_position_embeddings)
        self.prefill, self.decode = CachedStep(draft, "prefill"), CachedStep(draft)

    def reserve(self, rows: int, max_len: int) -> None:
        prepare_cache(self.draft, rows, max_len)

    def caches(self) -> list:
        return [self.draft.cache]

    def windows(self) -> list:
        return list(getattr(self.draft, "windows", ()))

    def start(self, run, hidden) -> None:
        p = run.prompts
        n, key_mask = p.n, run.slots.key_mask
        pos = p.position_ids()
        self.prefill(p.input_ids, pos, torch.arange(n, device=key_mask.device), key_mask if p.padded else None, n)

    def propose(self, run) -> Optional[Proposal]:
        slots, rule = run.slots, run.rule
        c = slots.frontier
        ids = torch.stack([run.prev, run.pending], dim=1)
        pos = step_positions(run.pos - 1, 2, self.limit).clamp_(min=0)
        logits = self.decode(ids, pos, slots.positions(2, -1), slots.key_mask, slots.kv_len(c))
        tokens, probs = [], []
        for i in range(self.k):
            if i > 0:
                tok = tokens[-1][:, None]
                pos = step_positions(run.pos + i, 1, self.limit)
                logits = self.decode(tok, pos, slots.positions(1, i), slots.key_mask, slots.kv_len(c + i))
            t, q = rule.choose(logits)
            tokens.append(t)
            probs.append(q)
        return Proposal(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if rule.sample else None)

    def describe(self) -> str:
        name = getattr(self.draft, "name_or_path", None) or type(self.draft).__name__
        return f"draft model {name} ({self.draft.config.num_hidden_layers} layers), k={self.k}"
