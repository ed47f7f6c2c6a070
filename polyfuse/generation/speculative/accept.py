"""How a verify step's drafted tokens are accepted, and how target tokens are chosen.

The target's logits over the k + 1 verified positions [rows, k + 1, V] become scores with transformers' order of
processors at each position (the repetition penalty over the ids seen up to that position, drafts before it
included; then the warpers when sampling), so position j's scores are exactly what the per-token loop would see
after accepting the drafts before it.

* greedy: ``g`` = argmax at every position; the drafts matching ``g`` from the first on are accepted (a), and the
  row emits ``g[:a + 1]``: the accepted drafts and the target's own next token. Token for token the output without
  speculation.
* sampling (Leviathan et al. 2023, Chen et al. 2023): draft ``d_j`` drawn from ``q_j`` is accepted with probability
  ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the next token is drawn from ``max(0, p_j - q_j)``
  renormalized, after k acceptances from ``p_{k+1}``. The emitted tokens are then distributed as the target's
  samples. A deterministic proposal (prompt lookup) is ``q_j`` = one-hot at ``d_j``.

Both return ``(accepted [rows], emitted [rows, k + 1])``: row r emits ``emitted[r, : accepted[r] + 1]``.
"""

from __future__ import annotations

from typing import Optional

import torch

from polyfuse.generation.logits_processors import penalize
from polyfuse.generation.sampling import warp


class TokenRule:
    """The run's token choice: greedy or sampling (temperature, top-k, top-p, the generator), with the penalty."""

    def __init__(self, options, generator: Optional[torch.Generator] = None):
        self.sample, self.generator, self.penalty = options.do_sample, generator, options.penalty
        self.warpers = (options.temperature, options.top_k, options.top_p)

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        """The sampling distribution of fp32 ``scores`` [..., V] (the warpers, then softmax)."""
        shape = scores.shape
        return warp(scores.reshape(-1, shape[-1]), *self.warpers).softmax(dim=-1).view(shape)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One id per row of ``probs`` [rows, V], drawn with the run's generator (on the generator's device)."""
        g = self.generator
        if g is not None and g.device.type != probs.device.type:
            return torch.multinomial(probs.to(g.device), 1, generator=g).squeeze(1).to(probs.device)
        return torch.multinomial(probs, 1, generator=g).squeeze(1)

    def uniform(self, shape: tuple, device) -> torch.Tensor:
        g = self.generator
        where = g.device if g is not None else device
        return torch.rand(shape, generator=g, device=where).to(device)

    def choose(self, logits: torch.Tensor):
        """(ids [rows], the distribution they were drawn from [rows, V] or None when greedy) for logits [rows, V]
        (a proposer's own choice: no penalty)."""
        if not self.sample:
            return logits.argmax(dim=-1), None
        probs = self.probs(logits.float())
        return self.draw(probs), probs


def position_scores(logits: torch.Tensor, seen: Optional[torch.Tensor], drafts: torch.Tensor, penalty) -> torch.Tensor:
    """fp32 scores [rows, W, V] of a verify step's logits: with the repetition penalty, position j over the ids
    ``seen`` [rows, V] so far plus the drafts before it (``drafts`` [rows, W - 1])."""
    scores = logits.float()
    if penalty is None:
        return scores
    masks = [seen]
    for j in range(drafts.shape[1]):
        masks.append(masks[-1].scatter(1, drafts[:, j : j + 1], True))
    return penalize(scores, torch.stack(masks, dim=1), penalty)


def greedy_accept(scores: torch.Tensor, proposal, rule: TokenRule):
    g = scores.argmax(dim=-1)
    k = scores.shape[1] - 1
    if k == 0:
        return torch.zeros_like(g[:, 0]), g
    accepted = (proposal.tokens == g[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1)
    return accepted, g


def sampled_accept(scores: torch.Tensor, proposal, rule: TokenRule):
    rows, width, vocab = scores.shape
    k, device = width - 1, scores.device
    p = rule.probs(scores)
    if k == 0:
        return torch.zeros(rows, dtype=torch.int64, device=device), rule.draw(p[:, 0])[:, None]
    drafts, q = proposal.tokens, proposal.probs
    p_d = p[:, :k].gather(2, drafts[..., None])[..., 0]
    q_d = torch.ones_like(p_d) if q is None else q.gather(2, drafts[..., None])[..., 0]
    # u < p/q with u uniform on [0, 1): accepted with probability min(1, p/q), no division
    ok = rule.uniform((rows, k), device) * q_d < p_d
    accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
    at = torch.arange(rows, device=device)
    p_next = p[at, accepted]
    rejected = accepted < k
    j = accepted.clamp(max=k - 1)
    if q is None:
        q_next = torch.zeros_like(p_next).scatter_(1, drafts[at, j][:, None], 1.0)
    else:
        q_next = q[at, j]
    residual = (p_next - q_next).clamp_min(0.0)
    # all of p's mass under q's is reachable only through float rounding: then draw from p itself
    usable = rejected[:, None] & (residual.sum(dim=1, keepdim=True) > 0)
    nxt = rule.draw(torch.where(usable, residual, p_next))
    emitted = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, accepted[:, None], nxt[:, None])
    return accepted, emitted


class ForcedAcceptance:
    """A replay rule for benchmarks and tests, not the target's output: row r accepts ``schedule(step, r)``
    drafts (at most k) whatever they are, then the target's greedy token there. It runs every step as a real run
    with that acceptance would (verify, drafting, cache commits), so its cost per emitted token is the real one."""

    def __init__(self, schedule):
        self.schedule, self.steps = schedule, 0

    def __call__(self, scores: torch.Tensor, proposal, rule: TokenRule):
        rows, width = scores.shape[:2]
        forced = [min(int(self.schedule(self.steps, r)), width - 1) for r in range(rows)]
        self.steps += 1
        accepted = torch.tensor(forced, dtype=torch.int64, device=scores.device)
        g = scores.argmax(dim=-1)
        drafts = proposal.tokens if proposal is not None else g[:, :0]
        emitted = torch.cat([drafts, g[:, -1:]], dim=1).scatter(1, accepted[:, None], g.gather(1, accepted[:, None]))
        return accepted, emitted
