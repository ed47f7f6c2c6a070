"""The per-token loop: each token chosen outside the step from its logits (sampling, stop strings, transformers'
logits processors and stopping criteria, runtimes without in-place decoding such as HPU), then fed back
(polyfuse.generation.feeds). In transformers' order: the fp32 logits, the repetition penalty, the other logits
processors (step_hooks.py), the warpers and the draw (or argmax); finished rows padded; EOS ids, stop strings and
stopping criteria."""

from __future__ import annotations

import torch

from polyfuse.generation.decoding import Decoding
from polyfuse.generation.logits_processors import mark_seen_, penalize, seen_mask
from polyfuse.generation.sampling import draw, warp


class TokenPicker:
    """``pick(i, logits [rows, V]) -> tokens [rows]`` for new position i; ``out`` holds every row's tokens so far
    and ``finished`` the rows that ended."""

    def __init__(self, d: Decoding):
        p = d.prompts
        device = p.input_ids.device
        self.d, self.options = d, d.options
        self.eos = torch.tensor(p.eos, device=device) if p.eos else None
        self.can_finish = self.eos is not None or d.stop is not None or d.criteria is not None
        self.finished = torch.zeros(p.rows, dtype=torch.bool, device=device)
        self.out = torch.full((p.rows, p.max_new_tokens), p.pad_token_id, dtype=p.input_ids.dtype, device=device)
        # The column written next, a device tensor advanced in place (optimum-habana's token_idx): a Python index
        # would be a constant of every token's graph, one compilation per token on a lazy-mode Gaudi.
        self.col = torch.zeros(1, dtype=torch.long, device=device)
        self.seen = None  # the repetition penalty's seen ids [rows, vocab], made at the first logits

    def ids_so_far(self, i: int) -> torch.Tensor:
        """Every row's prompt and its first ``i`` new tokens [rows, n + i]."""
        return torch.cat([self.d.prompts.input_ids, self.out[:, :i]], dim=1)

    def scores(self, i: int, logits: torch.Tensor) -> torch.Tensor:
        """The fp32 scores the token is chosen from: processed, then warped when sampling."""
        o, p, penalty = self.options, self.d.prompts, self.options.penalty
        scores = logits.float()
        if penalty is not None:
            if self.seen is None:
                self.seen = seen_mask(p.input_ids, logits.shape[-1], mask=p.padding_mask)
            scores = penalize(scores, self.seen, penalty)
        if self.d.processors is not None:
            scores = self.d.processors(self.ids_so_far(i), scores)
        return warp(scores, o.temperature, o.top_k, o.top_p) if o.do_sample else scores

    def __call__(self, i: int, logits: torch.Tensor) -> torch.Tensor:
        d, p = self.d, self.d.prompts
        scores = self.scores(i, logits)
        tok = draw(scores, d.generator) if self.options.do_sample else scores.argmax(dim=-1)
        if d.record is not None:
            d.record.add(logits, scores)
        if self.can_finish:
            tok = torch.where(self.finished, torch.full_like(tok, p.pad_token_id), tok)
        if self.eos is not None:
            self.finished.logical_or_(torch.isin(tok, self.eos))
        self.out.index_copy_(1, self.col, tok[:, None].to(self.out.dtype))
        self.col.add_(1)
        if self.seen is not None:
            mark_seen_(self.seen, tok)
        if d.stop is not None or d.criteria is not None:
            ids = self.ids_so_far(i + 1)
            if d.stop is not None:
                self.finished.logical_or_(d.stop(ids, p.n))
            if d.criteria is not None:
                self.finished.logical_or_(d.criteria(ids, d.record.scores_so_far() if d.record else None))
        if d.streamer is not None:
            d.streamer.put(tok.cpu())
        return tok

    def done(self, i: int) -> bool:
        """Token i was the last: the length is reached or every row has finished (a host sync)."""
        return i == self.d.prompts.max_new_tokens - 1 or (self.can_finish and bool(self.finished.all()))


def token_loop(d: Decoding, logits: torch.Tensor, feed) -> torch.Tensor:
    """Prompts + new tokens, from the prompt's ``logits`` [rows, V] and ``feed(tokens, i) -> next logits``."""
    pick = TokenPicker(d)
    for i in range(d.prompts.max_new_tokens):
        tok = pick(i, logits)
        d.boundary(i)
        if pick.done(i):
            break
        logits = feed(tok, i)
    return d.result(pick.out[:, : i + 1])
