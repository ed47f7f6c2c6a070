"""Beam search within the static KV cache, with transformers' semantics (``GenerationMixin._beam_search``).

Beams are batch rows: prompts are repeated ``num_beams`` times (rows ``b * num_beams + j``) and prefilled together,
so the static cache holds ``batch * num_beams`` rows. Every step keeps transformers' tensors and order of operations:
log-softmax of the fp32 logits, the repetition penalty on the log-probabilities (over each running beam's own ids),
running beam scores added, the top ``max(2, 1 + n_eos) * num_beams`` candidates over all beams of a prompt,
stopping criteria on the candidates (max length, EOS ids, stop strings), the best ``num_beams`` unfinished ones kept
running, finished ones merged into the kept hypotheses with the length penalty (score / new_length **
length_penalty), the early-stop heuristic (``early_stopping``: False, True or "never"). The output is the best
``num_return_sequences`` hypotheses per prompt, rows ``b * num_return_sequences + r``, cut to the longest of them
and padded after EOS with ``pad_token_id`` (transformers pads with ``pad_token_id or eos_token_id``: the EOS id
where the pad id is 0; everything else is the same).

The cache follows the beams: after each step every layer's keys and values are gathered by the parent-beam index,
in place and only over the positions written so far, before the next token is fed. The gather writes into the same
tensors, so the decode step's captured graph (CUDA or HPU) stays valid and replays as in the sampling loop; the beam
bookkeeping and the gather run eagerly around it, with one host sync per token for the stop decision. The greedy
in-place ``TokenStep`` (one replay per whole token) is not used for beam search.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

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


def beam_search(
    logits: torch.Tensor,
    advance: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    input_ids: torch.Tensor,
    num_beams: int,
    num_return_sequences: int,
    max_new_tokens: int,
    eos: Sequence[int],
    pad_token_id: int,
    repetition_penalty: float = 1.0,
    stop=None,
    length_penalty: float = 1.0,
    early_stopping: Union[bool, str] = False,
    after_step: Optional[Callable[[int], None]] = None,
) -> torch.Tensor:
    """Sequences [batch * num_return_sequences, n + generated].

    ``logits`` [rows, V]: the prefill's last-position logits for ``input_ids`` [rows = batch * num_beams, n], each
    prompt repeated ``num_beams`` times. ``advance(tokens [rows], beam_idx [rows], i)`` reorders the model's state rows
    by ``beam_idx`` (flat parent rows, positions < n + i), feeds ``tokens`` at position n + i and returns the next
    logits. ``stop``: a :class:`polyfuse.generation.stopping.StopStrings` or None. ``after_step(i)`` runs after the i-th
    selection (step boundaries, timing)."""
    device = logits.device
    rows, n = input_ids.shape
    k = num_beams
    b = rows // k
    max_length = n + max_new_tokens
    eos_t = torch.tensor(list(eos), device=device) if eos else None
    keep = max(2, 1 + len(eos)) * k
    top_mask = torch.cat((torch.ones(k, dtype=torch.bool), torch.zeros(keep - k, dtype=torch.bool))).to(device)

    running = torch.full((b, k, max_length), pad_token_id, dtype=torch.int64, device=device)
    running[:, :, :n] = input_ids.reshape(b, k, n)
    sequences = running.clone()
    running_scores = torch.zeros((b, k), dtype=torch.float, device=device)
    running_scores[:, 1:] = -1e9  # only the first beam's continuations count at the first step
    beam_scores = torch.full((b, k), -1e9, dtype=torch.float, device=device)
    finished = torch.zeros((b, k), dtype=torch.bool, device=device)
    improvable = torch.ones((b, 1), dtype=torch.bool, device=device)
    running_idx = torch.full((b, k, max_new_tokens), -1, dtype=torch.int32, device=device)
    beam_indices = running_idx.clone()
    offset = torch.arange(b, device=device).view(-1, 1) * k
    penalty = repetition_penalty if repetition_penalty != 1.0 else None
    seen = seen_mask(input_ids, logits.shape[-1]) if penalty is not None else None

    cur_len = n
    while True:
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        if seen is not None:
            log_probs = penalize(log_probs, seen, penalty)
        vocab = log_probs.shape[-1]
        acc = (log_probs.view(b, k, vocab) + running_scores[:, :, None]).reshape(b, k * vocab)

        # Top-K continuations over all beams of each prompt.
        topk_lp, topk_ix = torch.topk(acc, k=keep)
        parent = topk_ix // vocab
        topk_running_idx = _gather(running_idx, parent)
        topk_running = _gather(running, parent)
        topk_ids = topk_ix % vocab
        topk_running[:, :, cur_len] = topk_ids
        topk_running_idx[:, :, cur_len - n] = (parent + offset).to(torch.int32)

        # Which candidates hit a stopping criterion (max length, an EOS id, a stop string).
        hits = torch.full((b, keep), cur_len + 1 >= max_length, dtype=torch.bool, device=device)
        if eos_t is not None:
            hits |= (topk_ids[..., None] == eos_t).any(-1)
        if stop is not None:
            hits |= stop(topk_running[:, :, : cur_len + 1].reshape(b * keep, -1), n).view(b, keep)

        # The best num_beams unfinished candidates keep running.
        running_lp = topk_lp + hits.to(torch.float32) * -1.0e9
        next_ix = torch.topk(running_lp, k=k)[1]
        running = _gather(topk_running, next_ix)
        running_scores = _gather(running_lp, next_ix)
        running_idx = _gather(topk_running_idx, next_ix)

        # Finished candidates among the top num_beams join the hypotheses if they beat the kept ones.
        just_finished = hits & top_mask[None, :]
        scores = topk_lp / ((cur_len + 1 - n) ** length_penalty)
        full = torch.all(finished, dim=-1, keepdim=True) & (early_stopping is True)
        scores += full.to(torch.float32) * -1.0e9
        scores += (~improvable).to(torch.float32) * -1.0e9
        scores += (~just_finished) * -1.0e9
        merged_ix = torch.topk(torch.cat((beam_scores, scores), dim=1), k=k)[1]
        sequences = _gather(torch.cat((sequences, topk_running), dim=1), merged_ix)
        beam_scores = _gather(torch.cat((beam_scores, scores), dim=1), merged_ix)
        beam_indices = _gather(torch.cat((beam_indices, topk_running_idx), dim=1), merged_ix)
        finished = _gather(torch.cat((finished, just_finished), dim=1), merged_ix)

        beam_idx = running_idx[..., cur_len - n].reshape(-1).long()
        cur_len += 1
        # Early-stop heuristic: can the best running beam still beat the worst kept hypothesis?
        if early_stopping == "never" and length_penalty > 0.0:
            best_len = max_length - n
        else:
            best_len = cur_len - n
        best_running = running_scores[:, :1] / (best_len**length_penalty)
        worst_kept = torch.where(finished, torch.min(beam_scores, dim=1, keepdim=True)[0], -1.0e9)
        improvable = improvable & torch.any(best_running > worst_kept, dim=-1, keepdim=True)
        if after_step is not None:
            after_step(cur_len - n - 1)
        open_beam = not (early_stopping is True and bool(finished.all()))
        if not (bool(improvable.any()) and open_beam and not bool(hits.all())):
            break
        tokens = running[:, :, cur_len - 1].reshape(-1)
        if seen is not None:
            seen = seen.index_select(0, beam_idx)
            mark_seen_(seen, tokens)
        logits = advance(tokens, beam_idx, cur_len - 1 - n)

    sequences = sequences[:, :num_return_sequences].reshape(b * num_return_sequences, -1)
    beam_indices = beam_indices[:, :num_return_sequences].reshape(b * num_return_sequences, -1)
    generated = int((beam_indices + 1).bool().sum(dim=1).max())
    return sequences[:, : n + generated]
