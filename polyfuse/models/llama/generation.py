"""Batched generation over the static KV cache: one prefill step, then one call per token.

Every step is wrapped by the device runtime (``runtime.graph_module``), so CUDA graphs or HPU graphs replace it when
the run asks for them; everything here is device-agnostic. Greedy decoding (where ``runtime.inplace_decode``) runs
:class:`TokenStep`: the whole token (step, argmax, EOS bookkeeping, history write, advance of the inputs) in place
on persistent :class:`TokenState` buffers, so one graph replay per token is all the host launches. Sampling, and
runtimes without in-place decoding (HPU), run :class:`StepModule` and pick the token outside it.
"""

from __future__ import annotations

import time
import weakref
from typing import Optional, Sequence, Union

import torch
from torch import nn

from polyfuse.models.llama.sampling import next_token, validate_sampling


class StepModule(nn.Module):
    """A whole cached step as a module, the unit that device graphs capture."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, kv_len: int, input_ids, position_ids, cache_position, key_mask):
        return self.model.step(input_ids, position_ids, cache_position, key_mask, kv_len)


def _is_eos(ids: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    # A broadcast compare rather than torch.isin, which may sort (and sync) for larger inputs: no graph holds that.
    return (ids[..., None] == eos).any(-1)


def _greedy(logits, finished, eos: Optional[torch.Tensor], pad_token_id: int) -> torch.Tensor:
    """argmax token [B]; with EOS ids, rows already finished get ``pad_token_id`` and ``finished`` is updated in
    place with the rows that emit an EOS id now (what the per-token loop does with sampled tokens)."""
    tok = logits.argmax(dim=-1)
    if eos is not None:
        tok = tok.masked_fill(finished, pad_token_id)
        finished.logical_or_(_is_eos(tok, eos))
    return tok


class TokenStep(nn.Module):
    """One whole greedy token, in place: feeds ``tok`` at ``pos`` / ``cache_position``, writes the next token into
    ``history`` at column ``cache_position + 1``, then advances ``tok``, ``pos`` and ``cache_position`` to it.

    Every per-token value is a device tensor updated here, so a graph captured once per ``kv_len`` (the only Python
    value that varies) replays every token with no copies, argmax or bookkeeping launched around it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(
        self, kv_len: int, tok, pos, cache_position, key_mask, finished, history, eos=None, pad_token_id: int = 0
    ) -> None:
        logits = self.model.step(tok, pos, cache_position, key_mask, kv_len)
        new = _greedy(logits, finished, eos, pad_token_id)
        history.index_copy_(1, cache_position + 1, new[:, None])
        tok.copy_(new[:, None])
        pos.add_(1)
        cache_position.add_(1)


class TokenState:
    """The buffers :class:`TokenStep` reads and updates, one set per KV cache: graphs capture their addresses, so
    they live as long as the cache and every generate() on that cache reuses them (and the graphs)."""

    def __init__(self, batch: int, max_len: int, device):
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)
        self.key_mask = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.history = torch.zeros(batch, max_len, dtype=torch.long, device=device)  # column c: token at position c
        self._eos: dict = {}

    def eos(self, ids: Sequence[int]) -> Optional[torch.Tensor]:
        """The EOS ids as a device tensor, the same one for the same ids (a new one would mean a new capture)."""
        if not ids:
            return None
        if tuple(ids) not in self._eos:
            self._eos[tuple(ids)] = torch.tensor(ids, device=self.history.device)
        return self._eos[tuple(ids)]


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # StaticKVCache -> TokenState, dropped with it
_EOS_CHECK_EVERY = 8  # greedy decoding syncs on "every row finished?" once per this many tokens


def _token_state(cache) -> TokenState:
    state = _STATES.get(cache)
    if state is None:
        state = _STATES[cache] = TokenState(cache.batch, cache.max_len, cache.device)
    return state


def bucketed(length: int, bucket_size: int, limit: int) -> int:
    """Round ``length`` up to a multiple of ``bucket_size`` (no rounding when bucket_size <= 0), at most ``limit``."""
    if bucket_size <= 0:
        return length
    return min(-(-length // bucket_size) * bucket_size, max(limit, length))


def _steppers(model):
    """(prefill, decode, token) wrapped by the runtime; token is None where the runtime has no in-place decoding."""
    flags = getattr(model, "flags", {})
    cached = getattr(model, "_steppers", None)
    if cached is None or cached[0] is not model.kernels:
        step = StepModule(model)
        runtime = model.runtime
        token = runtime.graph_module(TokenStep(model), "token", flags) if runtime.inplace_decode else None
        cached = (
            model.kernels,
            runtime.graph_module(step, "prefill", flags),
            runtime.graph_module(step, "decode", flags),
            token,
        )
        model._steppers = cached
    return cached[1:]


def _sync(model):
    if model.runtime is not None:
        model.runtime.synchronize()


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    eos_token_id: Union[int, Sequence[int], None] = None,
    pad_token_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    ignore_eos: bool = False,
    bucket_size: int = -1,
    use_cache: bool = True,
    timings: Optional[dict] = None,
) -> torch.Tensor:
    """Return prompt + new ids [B, L + n]. Rows that reached EOS are filled with ``pad_token_id`` afterwards and
    generation stops once every row is done (unless ``ignore_eos``). Prompts are left-padded (``attention_mask``).
    ``use_cache=False`` recomputes the whole sequence every token (the baseline the KV cache is measured against)."""
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [batch >= 1, length >= 1], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    validate_sampling(temperature, top_k, top_p)
    cfg = model.config
    device = model.device
    b, n = input_ids.shape
    total = n + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {n} tokens + {max_new_tokens} new tokens exceeds the model's "
            f"{cfg.max_position_embeddings} positions"
        )
    if eos_token_id is None:
        eos_token_id = cfg.eos_token_id
    eos = (
        []
        if (ignore_eos or eos_token_id is None)
        else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    )
    if pad_token_id is None:
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)

    input_ids = input_ids.to(device)
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
    eos_t = torch.tensor(eos, device=device) if eos else None
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    out = torch.full((b, max_new_tokens), pad_token_id, dtype=input_ids.dtype, device=device)
    t_first = None

    def emit(i, logits):
        nonlocal t_first
        tok = next_token(logits, do_sample, temperature, top_k, top_p, generator)
        if eos_t is not None:
            tok = torch.where(finished, torch.full_like(tok, pad_token_id), tok)
            finished.logical_or_(torch.isin(tok, eos_t))
        out[:, i] = tok
        model.runtime.mark_step()
        if t_first is None:
            _sync(model)
            t_first = time.perf_counter()
        done = i == max_new_tokens - 1 or (eos_t is not None and bool(finished.all()))
        return tok, done

    if not use_cache:
        _sync(model)
        t0 = time.perf_counter()
        ids, m = input_ids, mask
        for i in range(max_new_tokens):
            pos = (m.long().cumsum(-1) - 1).masked_fill(~m, 1)
            logits = model(ids, attention_mask=m, position_ids=pos).logits[:, -1]
            tok, done = emit(i, logits)
            ids = torch.cat([ids, tok[:, None]], 1)
            m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
            if done:
                break
        _sync(model)
        if timings is not None:
            timings.update(first_token_s=t_first - t0, rest_s=time.perf_counter() - t_first, new_tokens=i + 1)
        return torch.cat([input_ids, out[:, : i + 1]], dim=1)

    cache_len = bucketed(total, bucket_size, cfg.max_position_embeddings)
    old_cache = model.cache
    model.allocate_cache(b, cache_len)
    prefill, decode, token = _steppers(model)
    rope = model.model.rotary_emb
    old_table = rope.cos_table
    rope.update_length(total)  # dynamic NTK scaling may rebuild the cos/sin tables
    if model.cache is not old_cache or rope.cos_table is not old_table:
        for s in (prefill, decode, token):
            if hasattr(s, "reset"):
                s.reset()  # captured graphs point at the old cache or tables
    in_place = token is not None and not do_sample
    state = _token_state(model.cache) if in_place else None
    key_mask = state.key_mask if in_place else torch.empty(b, model.cache.max_len, dtype=torch.bool, device=device)
    key_mask[:, :n] = mask
    key_mask[:, n:] = True
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)

    def kv_len_at(p: int) -> int:
        """The KV length a step at cache position ``p`` attends to."""
        return bucketed(p + 1, bucket_size, model.cache.max_len) if bucket_size > 0 else model.cache.max_len

    _sync(model)
    t0 = time.perf_counter()
    # Without padding the prompt needs no mask: attention runs plainly causal (SDPA's flash path).
    padded = attention_mask is not None and not bool(mask.all())
    logits = prefill(n, input_ids, position_ids, torch.arange(n, device=device), key_mask if padded else None)
    if in_place:
        new, t_first = _decode_in_place(
            model, token, state, logits, position_ids, max_new_tokens, eos, pad_token_id, kv_len_at
        )
    else:
        pos = position_ids[:, -1:] + 1
        steps = 0
        cache_positions = torch.arange(n, total, device=device)  # one upload; each step takes a view
        for i in range(max_new_tokens):
            tok, done = emit(i, logits)
            steps = i + 1
            if done:
                break
            cache_position = cache_positions[i : i + 1]
            logits = decode(kv_len_at(n + i), tok[:, None], pos, cache_position, key_mask)
            pos = pos + 1
        new = out[:, :steps]
    _sync(model)
    t_end = time.perf_counter()
    if timings is not None:
        timings.update(first_token_s=t_first - t0, rest_s=t_end - t_first, new_tokens=new.shape[1])
    return torch.cat([input_ids, new.to(input_ids.dtype)], dim=1)


def _decode_in_place(model, token, state, logits, position_ids, max_new_tokens, eos, pad_token_id, kv_len_at):
    """Greedy tokens [B, steps] after the prefill's ``logits``, and when the first was ready (after a sync): one
    ``token`` call per token and nothing else.

    "Every row finished?" is read back once per ``_EOS_CHECK_EVERY`` tokens, not every token, so up to that many
    extra steps may run; the result is then trimmed to the step where the last row finished, so it is exactly what
    the per-token loop returns."""
    n = position_ids.shape[1]
    eos_t = state.eos(eos)
    state.finished.zero_()
    first = _greedy(logits, state.finished, eos_t, pad_token_id)
    state.history[:, n] = first
    state.tok.copy_(first[:, None])
    state.pos.copy_(position_ids[:, -1:] + 1)
    state.cache_position.fill_(n)
    model.runtime.mark_step()
    _sync(model)
    t_first = time.perf_counter()
    args = (state.tok, state.pos, state.cache_position, state.key_mask, state.finished, state.history)
    steps = 1
    done = eos_t is not None and bool(state.finished.all())
    while steps < max_new_tokens and not done:
        token(kv_len_at(n + steps - 1), *args, eos_t, pad_token_id)  # feeds the token at position n + steps - 1
        model.runtime.mark_step()
        steps += 1
        done = eos_t is not None and steps % _EOS_CHECK_EVERY == 0 and bool(state.finished.all())
    new = state.history[:, n : n + steps]
    if eos_t is not None:
        # A row's first EOS id is where it finished (later ones are pads); the last row to finish ends generation.
        hit = _is_eos(new, eos_t)
        if bool(hit.any(1).all()):
            new = new[:, : int(hit.int().argmax(1).max()) + 1]
    return new, t_first
