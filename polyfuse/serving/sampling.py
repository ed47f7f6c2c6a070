"""Next tokens for a step's sequences, each with its own parameters: greedy rows by one argmax, sampled rows grouped
by (temperature, top_k, top_p) so each group is warped once (transformers' order: temperature, top-k, top-p;
polyfuse.generation.sampling.warp), then drawn: a seeded sequence from its own generator (its answer does not depend
on what else is in the batch), the others from the engine's. Log-probabilities are of the model's distribution (the
raw logits' log-softmax), as OpenAI's API reports them."""

from __future__ import annotations

from typing import Optional

import torch

from polyfuse.generation.sampling import warp


def _draw(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    if generator is not None and generator.device.type != probs.device.type:
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _index(rows: list, device) -> torch.Tensor:
    """Row indices on ``device``, copied without a host sync (a blocking copy would wait for the device's queue)."""
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def draw_tokens(logits: torch.Tensor, seqs: list, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token [len(seqs)] of each sequence, on the logits' device (no host sync but a seeded sequence's
    draw on another device's generator)."""
    if all(s.params.greedy for s in seqs):
        return logits.argmax(-1)
    logits = logits.float()
    tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    if greedy:
        rows = _index(greedy, logits.device)
        tokens[rows] = logits.index_select(0, rows).argmax(-1)
    groups: dict = {}
    for i, s in enumerate(seqs):
        if not s.params.greedy:
            p = s.params
            groups.setdefault((p.temperature, p.top_k or None, p.top_p), []).append(i)
    for (temperature, top_k, top_p), idx in groups.items():
        rows = _index(idx, logits.device)
        probs = warp(logits.index_select(0, rows), temperature, top_k, top_p).softmax(-1)
        shared = [j for j, i in enumerate(idx) if seqs[i].generator is None]
        if shared:
            pick = _index(shared, logits.device)
            tokens[rows[pick]] = _draw(probs.index_select(0, pick), generator)
        for j, i in enumerate(idx):
            if seqs[i].generator is not None:
                tokens[i] = _draw(probs[j : j + 1], seqs[i].generator)[0]
    return tokens


def sample(logits: torch.Tensor, seqs: list, generator: Optional[torch.Generator] = None):
    """(token ids [list of int], logprobs [list of None or (logprob, [(id, logprob), ...])]) for ``seqs``, whose
    logits are the rows of ``logits`` [len(seqs), vocab]."""
    tokens = draw_tokens(logits, seqs, generator)
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    logprobs: list = [None] * len(seqs)
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        picked = token_logprobs(logits.index_select(0, rows), tokens[rows], [seqs[i].params.logprobs for i in wanted])
        for i, lp in zip(wanted, picked):
            logprobs[i] = lp
    return tokens.tolist(), logprobs


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tops: list) -> list:
    """[(logprob, [(id, logprob), ...])] per row of ``logits`` [R, V]: the log-softmax at ``tokens`` [R] and the
    ``tops[r]`` most likely alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    own = lp.gather(1, tokens.to(lp.device)[:, None])[:, 0].tolist()
    k = max(tops)
    top = torch.topk(lp, k, dim=-1) if k > 0 else None
    top_v = top.values.tolist() if top is not None else None
    top_i = top.indices.tolist() if top is not None else None
    return [(own[j], list(zip(top_i[j][:n], top_v[j][:n])) if n else []) for j, n in enumerate(tops)]
