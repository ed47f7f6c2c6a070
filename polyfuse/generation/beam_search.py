"""Beam search within the static KV cache, with transformers' semantics (``GenerationMixin._beam_search``).

Beams are batch rows: prompts are repeated ``num_beams`` times (rows ``b * num_beams + j``) and prefilled together,
so the static cache holds ``batch * num_beams`` rows. Every step keeps transformers' tensors and order of operations:
log-softmax of the fp32 logits, the repetition penalty on the log-probabilities (over each running beam's own ids),
running beam scores added, the top ``max(2, 1 + n_eos) * num_beams`` candidates over all beams of a prompt,
stopping criteria on the candidates (max length, EOS ids, stop strings), the best ``num_beams`` unfinished ones kept
running, finished ones merged into the kept hypotheses with the length penalty (score / new_length **
length_penalty), the early-stop heuristic (``early_stopping``: False, True or "never"). The output is the best
``num_return_sequences`` hypotheses per prompt, rows ``b * num_return_sequences + r``, cut to the longest of them
and padded after EOS as transformers pads them: with ``pad_token_id``, the first EOS id where the pad id is 0,
-1 without EOS ids.

The cache follows the beams: after each step every layer's keys and values are gathered by the parent-beam index,
in place and only over the positions written so far, before the next token is fed. The gather writes into the same
tensors, so the decode step's captured graph (CUDA or HPU) stays valid and replays as in the sampling loop; the beam
bookkeeping and the gather run eagerly around it, with one host sync per token for the stop decision. The greedy
in-place ``TokenStep`` (one replay per whole token) is not used for beam search.
"""

from __future__ import annotations

from typing import Callable

import torch

from polyfuse.generation.decoding import Decoding
from polyfuse.generation.logits_processors import mark_seen_, penalize, seen_mask


def reorder_cache_(cache, beam_idx: torch.Tensor, length: int) -> None:
    """Gather rows of every layer's keys and values by ``beam_idx`` [rows], in place, over positions < ``length``."""
    for t in cache.k + cache.v:
        part = t[:, :, :length]
        part.copy_(part.index_select(0, beam_idx))


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """transformers' ``_gather_beams``: t [B, beams, ...] gathered along dim 1 by idx [B, k]."""
    while idx.dim() < t.dim():
        idx = idx.unsqueeze(-1)
    return torch.take_along_dim(t, idx, dim=1)


class BeamSearch:
    """The beams of every prompt ([B, num_beams] running, [B, num_beams] kept hypotheses) and one selection step."""

    def __init__(self, d: Decoding, vocab: int):
        p, o = d.prompts, d.options
        device = p.input_ids.device
        rows, n = p.input_ids.shape
        k = self.k = o.num_beams
        b = self.b = rows // k
        self.n, self.max_length, self.options, self.stop = n, n + p.max_new_tokens, o, d.stop
        self.processors, self.criteria, self.record = d.processors, d.criteria, d.record
        self.eos = torch.tensor(list(p.eos), device=device) if p.eos else None
        self.keep = max(2, 1 + len(p.eos)) * k
        top = (torch.ones(k, dtype=torch.bool), torch.zeros(self.keep - k, dtype=torch.bool))
        self.top_mask = torch.cat(top).to(device)
        # transformers' fill: ``pad_token_id or eos_token_id[0]`` (a pad id 0 gives the EOS id), -1 without EOS ids
        fill = (p.pad_token_id or p.eos[0]) if p.eos else -1
        self.running = torch.full((b, k, self.max_length), fill, dtype=torch.int64, device=device)
        self.running[:, :, :n] = p.input_ids.reshape(b, k, n)
        self.sequences = self.running.clone()
        self.running_scores = torch.zeros((b, k), dtype=torch.float, device=device)
        self.running_scores[:, 1:] = -1e9  # only the first beam's continuations count at the first step
        self.beam_scores = torch.full((b, k), -1e9, dtype=torch.float, device=device)
        self.finished = torch.zeros((b, k), dtype=torch.bool, device=device)
        self.improvable = torch.ones((b, 1), dtype=torch.bool, device=device)
        self.running_idx = torch.full((b, k, p.max_new_tokens), -1, dtype=torch.int32, device=device)
        self.beam_indices = self.running_idx.clone()
        self.offset = torch.arange(b, device=device).view(-1, 1) * k
        self.seen = seen_mask(p.input_ids, vocab, mask=p.padding_mask) if o.penalty is not None else None
        self.cur_len = n

    def _candidates(self, logits: torch.Tensor) -> tuple:
        """The top ``keep`` continuations over all beams of each prompt, and which hit a stopping criterion."""
        b, k, cur = self.b, self.k, self.cur_len
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        if self.seen is not None:
            log_probs = penalize(log_probs, self.seen, self.options.penalty)
        if self.processors is not None:  # transformers' processors on the running beams' ids so far
            log_probs = self.processors(self.running[:, :, :cur].reshape(b * k, cur), log_probs)
        if self.record is not None:
            self.record.add(logits, log_probs)
        vocab = log_probs.shape[-1]
        acc = (log_probs.view(b, k, vocab) + self.running_scores[:, :, None]).reshape(b, k * vocab)
        topk_lp, topk_ix = torch.topk(acc, k=self.keep)
        parent = topk_ix // vocab
        topk_running_idx = _gather(self.running_idx, parent)
        topk_running = _gather(self.running, parent)
        topk_ids = topk_ix % vocab
        topk_running[:, :, cur] = topk_ids
        topk_running_idx[:, :, cur - self.n] = (parent + self.offset).to(torch.int32)
        # Which candidates hit a stopping criterion (max length, an EOS id, a stop string).
        hits = torch.full((b, self.keep), cur + 1 >= self.max_length, dtype=torch.bool, device=logits.device)
        if self.eos is not None:
            hits |= (topk_ids[..., None] == self.eos).any(-1)
        candidates = topk_running[:, :, : cur + 1].reshape(b * self.keep, -1)
        if self.stop is not None:
            hits |= self.stop(candidates, self.n).view(b, self.keep)
        if self.criteria is not None:
            scores = self.record.scores_so_far() if self.record is not None else None
            hits |= self.criteria(candidates, scores).view(b, self.keep)
        return topk_lp, topk_running, topk_running_idx, hits

    def _merge_finished(self, topk_lp, topk_running, topk_running_idx, hits) -> None:
        """Finished candidates among the top num_beams join the hypotheses if they beat the kept ones."""
        o = self.options
        just_finished = hits & self.top_mask[None, :]
        scores = topk_lp / ((self.cur_len + 1 - self.n) ** o.length_penalty)
        full = torch.all(self.finished, dim=-1, keepdim=True) & (o.early_stopping is True)
        scores += full.to(torch.float32) * -1.0e9
        scores += (~self.improvable).to(torch.float32) * -1.0e9
        scores += (~just_finished) * -1.0e9
        merged_ix = torch.topk(torch.cat((self.beam_scores, scores), dim=1), k=self.k)[1]
        self.sequences = _gather(torch.cat((self.sequences, topk_running), dim=1), merged_ix)
        self.beam_scores = _gather(torch.cat((self.beam_scores, scores), dim=1), merged_ix)
        self.beam_indices = _gather(torch.cat((self.beam_indices, topk_running_idx), dim=1), merged_ix)
        self.finished = _gather(torch.cat((self.finished, just_finished), dim=1), merged_ix)

    def step(self, logits: torch.Tensor) -> torch.Tensor:
        """One selection from ``logits`` [rows, V]: the running beams advance by one token; returns the hits."""
        topk_lp, topk_running, topk_running_idx, hits = self._candidates(logits)
        # The best num_beams unfinished candidates keep running.
        running_lp = topk_lp + hits.to(torch.float32) * -1.0e9
        next_ix = torch.topk(running_lp, k=self.k)[1]
        self.running = _gather(topk_running, next_ix)
        self.running_scores = _gather(running_lp, next_ix)
        self.running_idx = _gather(topk_running_idx, next_ix)
        self._merge_finished(topk_lp, topk_running, topk_running_idx, hits)
        self.beam_idx = self.running_idx[..., self.cur_len - self.n].reshape(-1).long()
        self.cur_len += 1
        # Early-stop heuristic: can the best running beam still beat the worst kept hypothesis?
        o = self.options
        if o.early_stopping == "never" and o.length_penalty > 0.0:
            best_len = self.max_length - self.n
        else:
            best_len = self.cur_len - self.n
        best_running = self.running_scores[:, :1] / (best_len**o.length_penalty)
        worst_kept = torch.where(self.finished, torch.min(self.beam_scores, dim=1, keepdim=True)[0], -1.0e9)
        self.improvable = self.improvable & torch.any(best_running > worst_kept, dim=-1, keepdim=True)
        return hits

    def done(self, hits: torch.Tensor) -> bool:
        open_beam = not (self.options.early_stopping is True and bool(self.finished.all()))
        return not (bool(self.improvable.any()) and open_beam and not bool(hits.all()))

    def next_tokens(self) -> torch.Tensor:
        """The running beams' last tokens [rows] (the seen ids follow the beams' parents)."""
        tokens = self.running[:, :, self.cur_len - 1].reshape(-1)
        if self.seen is not None:
            self.seen = self.seen.index_select(0, self.beam_idx)
            mark_seen_(self.seen, tokens)
        return tokens

    def best(self, num_return_sequences: int) -> torch.Tensor:
        """The best hypotheses per prompt, rows b * num_return_sequences + r, cut to the longest of them; their
        scores and beam indices (transformers' ``sequences_scores`` and ``beam_indices``) are kept as
        ``self.chosen``."""
        r = num_return_sequences
        sequences = self.sequences[:, :r].reshape(self.b * r, -1)
        beam_indices = self.beam_indices[:, :r].reshape(self.b * r, -1)
        generated = int((beam_indices + 1).bool().sum(dim=1).max())
        self.chosen = (self.beam_scores[:, :r].reshape(-1), beam_indices[:, :generated])
        return sequences[:, : self.n + generated]


def beam_search(d: Decoding, logits: torch.Tensor, advance: Callable) -> torch.Tensor:
    """Sequences [batch * num_return_sequences, n + generated].

    ``logits`` [rows, V]: the prompt's last-position logits for ``d.prompts`` (rows = batch * num_beams, each prompt
    repeated num_beams times). ``advance(tokens [rows], beam_idx [rows], i)`` reorders the model's state rows by
    ``beam_idx`` (flat parent rows, positions < n + i), feeds ``tokens`` at position n + i and returns the next
    logits (polyfuse.generation.feeds)."""
    beams = BeamSearch(d, logits.shape[-1])
    while True:
        hits = beams.step(logits)
        i = beams.cur_len - beams.n - 1
        d.boundary(i)
        if beams.done(hits):
            break
        logits = advance(beams.next_tokens(), beams.beam_idx, i)
    sequences = beams.best(d.options.num_return_sequences).to(d.prompts.input_ids.dtype)
    d.beam_outputs = beams.chosen
    return sequences
