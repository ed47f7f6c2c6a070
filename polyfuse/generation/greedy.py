"""Greedy decoding in place: after the prompt, one call of the runtime-wrapped ``TokenStep`` per token and nothing
else (under CUDA graphs: one replay per token), on the cache's persistent :class:`TokenState` buffers.

"Every row finished?" is read back once per ``EOS_CHECK_EVERY`` tokens, not every token, so up to that many extra
steps may run; the result is then trimmed to the step where the last row finished, so it is exactly what the
per-token loop returns. With a streamer each token is read back (and the check made) after its step. The
repetition penalty runs inside the step, on the state's persistent seen-ids mask.
"""

from __future__ import annotations

import torch

from polyfuse.generation.decoding import Decoding
from polyfuse.generation.kv_cache import kv_len_at
from polyfuse.generation.logits_processors import mark_seen_, penalize, seen_mask
from polyfuse.generation.token_state import TokenState, greedy_token, is_eos


EOS_CHECK_EVERY = 8  # greedy decoding syncs on "every row finished?" once per this many tokens


def _first_token(d: Decoding, state: TokenState, logits, eos) -> tuple:
    """The first new token, chosen from the prompt's logits outside the step; the step's penalty arguments."""
    p, penalty = d.prompts, d.options.penalty
    extra = ()
    if penalty is not None:
        seen = seen_mask(p.input_ids, logits.shape[-1], out=state.seen(logits.shape[-1]), mask=p.padding_mask)
        logits = penalize(logits.float(), seen, penalty)
        extra = (seen, penalty)
    first = greedy_token(logits, state.finished, eos, p.pad_token_id)
    if penalty is not None:
        mark_seen_(seen, first)
    return first, extra


def _trimmed(new: torch.Tensor, eos) -> torch.Tensor:
    """A row's first EOS id is where it finished (later ones are pads); the last row to finish ends generation."""
    if eos is not None:
        hit = is_eos(new, eos)
        if bool(hit.any(1).all()):
            new = new[:, : int(hit.int().argmax(1).max()) + 1]
    return new


def greedy_in_place(d: Decoding, token, state: TokenState, logits: torch.Tensor, next_pos: torch.Tensor):
    """Prompts + greedy tokens after the prompt's ``logits`` [rows, V]; ``token``: the wrapped TokenStep,
    ``next_pos`` [rows, 1]: each row's position of its first new token."""
    p, n = d.prompts, d.prompts.n
    eos = state.eos(p.eos)
    state.finished.zero_()
    first, extra = _first_token(d, state, logits, eos)
    state.history[:, n] = first
    state.tok.copy_(first[:, None])
    state.pos.copy_(next_pos)
    state.cache_position.fill_(n)
    d.boundary(0)
    if d.streamer is not None:
        d.streamer.put(first.cpu())
    check_every = 1 if d.streamer is not None else EOS_CHECK_EVERY
    max_len, args = d.model.cache.max_len, state.args()
    steps = 1
    done = eos is not None and bool(state.finished.all())
    while steps < p.max_new_tokens and not done:
        kv_len = kv_len_at(n + steps - 1, d.options.bucket_size, max_len)
        token(kv_len, *args, eos, p.pad_token_id, *extra)  # feeds the token at n + steps - 1
        d.boundary(steps)
        steps += 1
        if d.streamer is not None:
            d.streamer.put(state.history[:, n + steps - 1].cpu())
        done = eos is not None and steps % check_every == 0 and bool(state.finished.all())
    return d.result(_trimmed(state.history[:, n : n + steps], eos))
