"""Prompt lookup (n-gram matching), with transformers' ``prompt_lookup_num_tokens`` semantics
(``PromptLookupCandidateGenerator``): per row, the longest trailing n-gram of the sequence so far (n from
``max_matching_ngram_size`` down to 1) is looked for in the sequence, leftmost match first; the k tokens that
followed it are the drafts, cut before the first EOS id. No second model: what pays is input-grounded text
(summaries, rewrites, code edits) that repeats spans of the prompt.

A row with no match drafts nothing: its k slots are filled with its pending token (verified and, unless the target
agrees, rejected). When no row matches, the step verifies only the pending tokens: a plain decode step.
"""

from __future__ import annotations

from typing import Optional

import torch

from polyfuse.generation.speculative.proposer import Proposal, Proposer


def lookup(seq: torch.Tensor, k: int, ngram: int, eos: set) -> list:
    """The drafts for one row's tokens ``seq`` [L] (CPU): up to ``k`` tokens, [] without a match."""
    length = seq.shape[0]
    for n in range(min(ngram, length - 1), 0, -1):
        windows = seq.unfold(0, n, 1)
        starts = (windows == seq[-n:]).all(dim=1).nonzero()[:, 0] + n
        starts = starts[starts < length]  # the trailing n-gram matching itself has no continuation
        if starts.numel():
            start = int(starts[0])
            chosen = seq[start : min(start + k, length)].tolist()
            cut = next((i for i, t in enumerate(chosen) if t in eos), len(chosen))
            return chosen[:cut]
    return []


class PromptLookup(Proposer):
    name = "prompt_lookup"

    def __init__(self, k: int, ngram: int, eos):
        super().__init__(k)
        self.ngram, self.eos = ngram, set(eos)

    def propose(self, run) -> Optional[Proposal]:
        out = run.outputs
        drafts = [lookup(torch.tensor(out.history(r)), self.k, self.ngram, self.eos) if not out.done(r) else []
                  for r in range(run.prompts.rows)]  # fmt: skip
        if not any(drafts):
            return None
        pending = run.pending.tolist()
        rows = [d + [pending[r]] * (self.k - len(d)) for r, d in enumerate(drafts)]
        return Proposal(torch.tensor(rows, dtype=torch.int64, device=run.pending.device))

    def describe(self) -> str:
        return f"prompt_lookup (n-gram matching, n <= {self.ngram}), k={self.k}"
