"""EAGLE-3 heads as a proposer (the head itself: polyfuse/models/eagle3.py, duck-typed here): a chain of k drafts
from the target's hidden states.

* prompt: the target's prompt step returns its residual stream at the head's three layers; the head runs over the
  prompt (position j: the target's features at j with token j + 1, the first new token last) and its last position
  drafts d_1.
* propose: d_1, then k - 1 one-position head steps (the previous output as hidden input, the previous draft as
  token), at the slots after the frontier; each drafts the next.
* accepted: the head runs over the k + 1 verified positions (the target's features there, each with the token that
  follows it: the accepted drafts, then the target's own next token at each row's accepted length); each row's
  output at its accepted length drafts the next round's d_1. Its slots past that are holes or are overwritten, as
  the target's are.

The head's steps run through its runtime's graphs (one per shape and KV length: prompt, k + 1 positions, one).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from polyfuse.generation.kv_cache import ensure_cache
from polyfuse.generation.speculative.proposer import Proposal, Proposer
from polyfuse.generation.speculative.verify import step_positions


class HeadStep(nn.Module):
    """The head's cached step as a module, the unit device graphs capture."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, kv_len: int, input_ids, position_ids, cache_position, key_mask, hidden, select=None):
        return self.head.draft_step(input_ids, position_ids, cache_position, key_mask, kv_len, hidden, select)


def head_step(head):
    """The head's graph-wrapped step, made once per head (graphs persist across generate() calls)."""
    if getattr(head, "steps", None) is None:
        head.steps = head.runtime.graph_module(HeadStep(head), "decode", head.flags)
    return head.steps


def check_head(head, target) -> None:
    if not callable(getattr(head, "draft_step", None)):
        raise ValueError(
            f"speculative_model must be EAGLE-3 heads (polyfuse.models.eagle3_checkpoint.load_eagle3, or a path "
            f"given to model.generate), got {type(head).__name__}"
        )
    if head.target_hidden_size != target.config.hidden_size:
        raise ValueError(f"EAGLE-3 heads read hidden states of size {head.target_hidden_size}; the model's hidden "
                         f"size is {target.config.hidden_size}")  # fmt: skip
    if head.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"EAGLE-3 heads map drafts into {head.config.vocab_size} tokens; the model's vocabulary has "
                         f"{target.config.vocab_size}")  # fmt: skip
    if head.device != target.device:
        raise ValueError(f"EAGLE-3 heads are on {head.device}, the model on {target.device}")


class Eagle3(Proposer):
    name = "eagle3"

    def __init__(self, head, target, k: int):
        check_head(head, target)
        super().__init__(k)
        self.head, self.vocab = head, target.config.vocab_size
        self.hidden_layers = head.capture_layers(target.config.num_hidden_layers)
        self.step = head_step(head)
        self.hot = head.hot_ids()
        self.limit = target.config.max_position_embeddings

    def reserve(self, rows: int, max_len: int) -> None:
        if ensure_cache(self.head, rows, max_len) | self.head.prepare_positions(max_len):
            self.step.reset()

    def caches(self) -> list:
        return [self.head.cache]

    def _choose(self, run, logits: torch.Tensor):
        """Target ids [rows] drafted from draft-vocabulary logits, and their distribution over the target's
        vocabulary [rows, V] when sampling."""
        t, q = run.rule.choose(logits)
        if q is not None:
            q = q.new_zeros(q.shape[0], self.vocab).index_copy_(1, self.hot, q)
        return self.hot[t], q

    def _drafted(self, run, logits, out) -> None:
        self.hidden = out.clone()  # a graph's output buffer: the next replay overwrites it
        self.first = self._choose(run, logits)

    def start(self, run, hidden) -> None:
        p, slots = run.prompts, run.slots
        n = p.n
        ids = torch.cat([p.input_ids[:, 1:], run.pending[:, None]], dim=1)
        last = torch.full((p.rows,), n - 1, dtype=torch.int64, device=ids.device)
        logits, out = self.step(slots.kv_len(n - 1), ids, p.position_ids(), torch.arange(n, device=ids.device),
                                slots.key_mask, hidden, last)  # fmt: skip
        self._drafted(run, logits, out)

    def propose(self, run) -> Optional[Proposal]:
        slots = run.slots
        tok, q = self.first
        tokens, probs, hidden = [tok], [q], self.hidden
        for i in range(1, self.k):
            pos = step_positions(run.pos + i - 1, 1, self.limit)
            last = slots.frontier + i - 1
            logits, hidden = self.step(slots.kv_len(last), tok[:, None], pos, slots.positions(1, i - 1),
                                       slots.key_mask, hidden[:, None])  # fmt: skip
            tok, q = self._choose(run, logits)
            tokens.append(tok)
            probs.append(q)
        return Proposal(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if run.rule.sample else None)

    def accepted(self, run, proposal, accepted, emitted, hidden) -> None:
        slots, width = run.slots, emitted.shape[1]
        pos = step_positions(run.pos, width, self.limit)
        logits, out = self.step(slots.kv_len(slots.frontier + width - 1), emitted, pos, slots.positions(width),
                                slots.key_mask, hidden, accepted)  # fmt: skip
        self._drafted(run, logits, out)

    def describe(self) -> str:
        head = self.head
        where = head.name_or_path or "in memory"
        return (f"eagle3 heads {where} (draft vocabulary {head.draft_vocab}, target layers "
                f"{'/'.join(str(i) for i in self.hidden_layers)}), chain of k={self.k}")  # fmt: skip
