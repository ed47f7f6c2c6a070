"""Batched generation over the static KV cache: one prefill step, then one call per token.

Every step is wrapped by the device runtime (``runtime.graph_module``), so CUDA graphs or HPU graphs replace it when
the run asks for them; everything here is device-agnostic. Greedy decoding (where ``runtime.inplace_decode``) runs
:class:`TokenStep`: the whole token (step, argmax, EOS bookkeeping, history write, advance of the inputs) in place
on persistent :class:`TokenState` buffers, so one graph replay per token is all the host launches. Sampling, and
runtimes without in-place decoding (HPU), run :class:`StepModule` and pick the token outside it.

Features with transformers' ``generate`` semantics, and where they run:

* ``repetition_penalty`` (polyfuse.generation.logits_processors): greedy decoding keeps the in-place TokenStep and its
  CUDA graph; the penalty runs inside it, on a persistent per-row "seen" mask [rows, vocab] updated in place. Sampling
  and the HPU per-token loop apply it to the logits outside the step.
* ``num_beams`` (polyfuse.generation.beam_search): beams are rows of the static cache (batch * num_beams), gathered in
  place by parent beam every token. It runs the per-token loop: the decode step still replays its graph, the beam
  bookkeeping and the cache gather run eagerly around it (the in-place TokenStep graph is bypassed).
* ``num_return_sequences``: prompts repeated (sampling) or the best hypotheses kept (beam search).
* ``stop_strings`` (polyfuse.generation.stopping, needs ``tokenizer``) run the per-token loop (the decode step replays
  its graph; the check is on the host, once per token); ``stop_token_ids`` are extra EOS ids and keep every path.
* ``streamer`` (polyfuse.generation.streaming): put(prompt), put(token) per position, end(). Under the in-place TokenStep
  the token is read back after every replay (one sync per token instead of one per 8).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence, Union

import torch
from torch import nn

from polyfuse.generation.beam_search import beam_search, reorder_cache_
from polyfuse.generation.kv_cache import StaticKVCache
from polyfuse.generation.logits_processors import mark_seen_, penalize, seen_mask
from polyfuse.generation.padding import to_left_padding
from polyfuse.generation.sampling import next_token, validate_sampling
from polyfuse.generation.stopping import StopStrings, as_stop_strings


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
        self,
        kv_len: int,
        tok,
        pos,
        cache_position,
        key_mask,
        finished,
        history,
        eos=None,
        pad_token_id: int = 0,
        seen=None,
        penalty: float = 1.0,
    ) -> None:
        logits = self.model.step(tok, pos, cache_position, key_mask, kv_len)
        if seen is not None:  # repetition penalty: the row's seen ids, a persistent mask updated here
            logits = penalize(logits.float(), seen, penalty)
        new = _greedy(logits, finished, eos, pad_token_id)
        if seen is not None:
            mark_seen_(seen, new)
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
        self._seen: Optional[torch.Tensor] = None

    def seen(self, vocab: int) -> torch.Tensor:
        """The repetition penalty's seen-ids mask [batch, vocab], allocated on first use and kept (graphs hold it)."""
        if self._seen is None or self._seen.shape[1] != vocab:
            self._seen = torch.zeros(self.history.shape[0], vocab, dtype=torch.bool, device=self.history.device)
        return self._seen

    def eos(self, ids: Sequence[int]) -> Optional[torch.Tensor]:
        """The EOS ids as a device tensor, the same one for the same ids (a new one would mean a new capture)."""
        if not ids:
            return None
        if tuple(ids) not in self._eos:
            self._eos[tuple(ids)] = torch.tensor(ids, device=self.history.device)
        return self._eos[tuple(ids)]


_EOS_CHECK_EVERY = 8  # greedy decoding syncs on "every row finished?" once per this many tokens


def _token_state(cache) -> TokenState:
    if cache.token_state is None:
        cache.token_state = TokenState(cache.batch, cache.max_len, cache.device)
    state = cache.token_state
    return state


def bucketed(length: int, bucket_size: int, limit: int) -> int:
    """Round ``length`` up to a multiple of ``bucket_size`` (no rounding when bucket_size <= 0), at most ``limit``."""
    if bucket_size <= 0:
        return length
    return min(-(-length // bucket_size) * bucket_size, max(limit, length))


def _steppers(model):
    """(prefill, decode, token) wrapped by the runtime, kept per model while its kernels stay the same; token is
    None where the runtime has no in-place decoding."""
    cached = getattr(model, "steps", None)
    if cached is None or cached[0] is not model.kernels:
        flags, runtime, step = model.flags, model.runtime, StepModule(model)
        token = runtime.graph_module(TokenStep(model), "token", flags) if runtime.inplace_decode else None
        cached = (
            model.kernels,
            runtime.graph_module(step, "prefill", flags),
            runtime.graph_module(step, "decode", flags),
            token,
        )
        model.steps = cached
    return cached[1:]


def forget_steppers(model) -> None:
    """Drop the model's step wrappers (and the graphs they captured); the next generate() makes new ones."""
    model.steps = None


def ensure_cache(model, batch: int, max_len: int) -> bool:
    """Give ``model.cache`` room for ``batch`` x ``max_len``; True when a new cache was allocated."""
    cache = model.cache
    if cache is not None and cache.fits(batch, max_len, model.dtype, model.device):
        return False
    model.cache = None  # free the old one first
    layers, kv_heads, head_dim = model.kv_cache_layout()
    model.cache = StaticKVCache(layers, batch, kv_heads, max_len, head_dim, model.dtype, model.device)
    return True


def _sync(model):
    if model.runtime is not None:
        model.runtime.synchronize()


def check_generation_options(
    do_sample: bool = False,
    repetition_penalty: float = 1.0,
    num_beams: int = 1,
    num_return_sequences: int = 1,
    early_stopping: Union[bool, str] = False,
    stop_strings: Union[str, Sequence[str], None] = None,
    tokenizer=None,
    streamer=None,
) -> None:
    """One-line ValueErrors for the options below that cannot run (the CLI prints them as ``error:`` lines)."""
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, int) or num_return_sequences < 1:
        raise ValueError(f"num_return_sequences must be an integer >= 1, got {num_return_sequences!r}")
    if not isinstance(repetition_penalty, (int, float)) or not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty!r}")
    if num_beams > 1:
        if do_sample:
            raise ValueError(
                "beam sampling (do_sample with num_beams > 1) is not supported: use num_beams=1 to sample, or "
                "do_sample=False for beam search"
            )
        if num_return_sequences > num_beams:
            raise ValueError(
                f"num_return_sequences ({num_return_sequences}) must be <= num_beams ({num_beams}) for beam search"
            )
        if streamer is not None:
            raise ValueError("streaming is not supported with beam search (num_beams > 1), as in transformers")
    elif num_return_sequences > 1 and not do_sample:
        raise ValueError(
            f"num_return_sequences={num_return_sequences} needs do_sample=True or num_beams >= num_return_sequences "
            "(greedy decoding returns one sequence per prompt)"
        )
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if as_stop_strings(stop_strings) and tokenizer is None:
        raise ValueError(
            "stop_strings needs tokenizer= (a tokenizer, or a callable decoding a list of token ids to text)"
        )
    if streamer is not None and not (
        callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))
    ):
        raise ValueError(f"streamer must have put(token_ids) and end() methods, got {type(streamer).__name__}")


def _ids(value: Union[int, Sequence[int], None]) -> list:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


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
    repetition_penalty: float = 1.0,
    num_beams: int = 1,
    num_return_sequences: int = 1,
    length_penalty: float = 1.0,
    early_stopping: Union[bool, str] = False,
    stop_strings: Union[str, Sequence[str], None] = None,
    stop_token_ids: Union[int, Sequence[int], None] = None,
    tokenizer=None,
    streamer=None,
) -> torch.Tensor:
    """Return prompt + new ids [B, L + n]. Rows that reached EOS are filled with ``pad_token_id`` afterwards and
    generation stops once every row is done (unless ``ignore_eos``). Prompts are left-padded (``attention_mask``).
    ``use_cache=False`` recomputes the whole sequence every token (the baseline the KV cache is measured against).

    transformers' options, with its semantics:

    * ``repetition_penalty`` (> 0, 1.0: off): over each row's prompt and generated ids, positive logits divided by
      it, negative ones multiplied. Greedy decoding applies it inside the in-place TokenStep (under CUDA graphs: in
      the graph, on a persistent per-row seen-ids mask); sampling and the HPU loop apply it outside the step.
    * ``num_beams`` > 1: beam search (``length_penalty``, ``early_stopping`` as in transformers; no sampling). Beams
      are rows of the static cache, reordered in place each token; the greedy TokenStep graph is bypassed (the decode
      step's graph still replays, the beam bookkeeping runs eagerly around it, one sync per token).
    * ``num_return_sequences``: sequences per prompt, rows ``b * num_return_sequences + r`` of the result: sampled
      independently (do_sample) or the best hypotheses of beam search (<= num_beams).
    * ``stop_strings`` (str or list; needs ``tokenizer``: a tokenizer, or a callable decoding a list of ids to text):
      a row stops at the token completing a stop string, as transformers' StopStringCriteria; runs the per-token loop.
      ``stop_token_ids``: extra ids that end a row like EOS (kept with ``ignore_eos``).
    * ``streamer``: an object with ``put(ids)`` / ``end()`` (transformers' BaseStreamer, e.g. TextStreamer): gets
      the prompt, then each position's tokens [rows] as they are produced, then end(). Not with beam search. Under
      the in-place TokenStep this reads each token back after its replay (one sync per token, not one per 8).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [batch >= 1, length >= 1], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    validate_sampling(temperature, top_k, top_p)
    check_generation_options(
        do_sample,
        repetition_penalty,
        num_beams,
        num_return_sequences,
        early_stopping,
        stop_strings,
        tokenizer,
        streamer,
    )
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
    eos = [] if (ignore_eos or eos_token_id is None) else _ids(eos_token_id)
    eos += [t for t in _ids(stop_token_ids) if t not in eos]
    if pad_token_id is None:
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)

    input_ids = input_ids.to(device)
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
    input_ids, mask = to_left_padding(input_ids, mask)  # a right-padded batch generates as its left-padded twin
    copies = num_beams if num_beams > 1 else num_return_sequences
    if copies > 1:  # rows b * copies + j, as transformers expands them
        input_ids = input_ids.repeat_interleave(copies, dim=0)
        mask = mask.repeat_interleave(copies, dim=0)
        b *= copies
    stop = StopStrings(stop_strings, tokenizer) if as_stop_strings(stop_strings) else None
    penalty = float(repetition_penalty) if repetition_penalty != 1.0 else None
    eos_t = torch.tensor(eos, device=device) if eos else None
    can_finish = eos_t is not None or stop is not None
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    out = torch.full((b, max_new_tokens), pad_token_id, dtype=input_ids.dtype, device=device)
    seen = None  # the repetition penalty's seen ids [rows, vocab], made at the first logits
    t_first = None
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def emit(i, logits):
        nonlocal t_first, seen
        if penalty is not None:
            if seen is None:
                seen = seen_mask(input_ids, logits.shape[-1])
            logits = penalize(logits.float(), seen, penalty)
        tok = next_token(logits, do_sample, temperature, top_k, top_p, generator)
        if can_finish:
            tok = torch.where(finished, torch.full_like(tok, pad_token_id), tok)
        if eos_t is not None:
            finished.logical_or_(torch.isin(tok, eos_t))
        out[:, i] = tok
        if seen is not None:
            mark_seen_(seen, tok)
        if stop is not None:
            finished.logical_or_(stop(torch.cat([input_ids, out[:, : i + 1]], dim=1), n))
        if streamer is not None:
            streamer.put(tok.cpu())
        model.runtime.mark_step()
        if t_first is None:
            _sync(model)
            t_first = time.perf_counter()
        done = i == max_new_tokens - 1 or (can_finish and bool(finished.all()))
        return tok, done

    def first_token_time(i):
        nonlocal t_first
        model.runtime.mark_step()
        if i == 0:
            _sync(model)
            t_first = time.perf_counter()

    def beams(logits, advance):
        return beam_search(
            logits, advance, input_ids, num_beams, num_return_sequences, max_new_tokens, eos, pad_token_id,
            repetition_penalty, stop, length_penalty, early_stopping, after_step=first_token_time,
        )  # fmt: skip

    def finish(result, t0):
        _sync(model)
        if timings is not None:
            new_tokens = result.shape[1] - n
            timings.update(first_token_s=t_first - t0, rest_s=time.perf_counter() - t_first, new_tokens=new_tokens)
        if streamer is not None:
            streamer.end()
        return result

    if not use_cache:
        _sync(model)
        t0 = time.perf_counter()

        def forward(ids, m):
            pos = (m.long().cumsum(-1) - 1).masked_fill(~m, 1)
            return model(ids, attention_mask=m, position_ids=pos).logits[:, -1]

        if num_beams > 1:
            state = {"ids": input_ids, "mask": mask}

            def advance(tokens, beam_idx, i):
                state["ids"] = torch.cat([state["ids"].index_select(0, beam_idx), tokens[:, None]], 1)
                state["mask"] = torch.cat([state["mask"], torch.ones_like(state["mask"][:, :1])], 1)
                return forward(state["ids"], state["mask"])

            return finish(beams(forward(input_ids, mask), advance).to(input_ids.dtype), t0)
        ids, m = input_ids, mask
        for i in range(max_new_tokens):
            tok, done = emit(i, forward(ids, m))
            ids = torch.cat([ids, tok[:, None]], 1)
            m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
            if done:
                break
        return finish(torch.cat([input_ids, out[:, : i + 1]], dim=1), t0)

    cache_len = bucketed(total, bucket_size, cfg.max_position_embeddings)
    new_cache = ensure_cache(model, b, cache_len)
    prefill, decode, token = _steppers(model)
    new_tables = model.prepare_positions(total)  # dynamic NTK scaling may rebuild the cos/sin tables
    if new_cache or new_tables:
        for s in (prefill, decode, token):
            if s is not None:
                s.reset()  # captured graphs point at the old cache or tables
    in_place = token is not None and not do_sample and num_beams == 1 and stop is None
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
    pos = position_ids[:, -1:] + 1
    cache_positions = torch.arange(n, total, device=device)  # one upload; each step takes a view
    if num_beams > 1:
        slot = cache_positions[:1].clone()  # one tensor set in place per step: HPU graphs key on input views

        def advance(tokens, beam_idx, i):
            reorder_cache_(model.cache, beam_idx, n + i)  # in place: captured decode graphs stay valid
            slot.fill_(n + i)
            return decode(kv_len_at(n + i), tokens[:, None], pos + i, slot, key_mask)

        return finish(beams(logits, advance).to(input_ids.dtype), t0)
    if in_place:
        new, t_first = _decode_in_place(
            model, token, state, logits, input_ids, position_ids, max_new_tokens, eos, pad_token_id, kv_len_at,
            penalty, streamer,
        )  # fmt: skip
    else:
        steps = 0
        # One tensor advanced in place, like optimum-habana's token_idx: HPU graphs key on input views, so a moving
        # slice cache_positions[i : i + 1] would capture a new graph every token.
        cache_position = cache_positions[:1].clone()
        for i in range(max_new_tokens):
            tok, done = emit(i, logits)
            steps = i + 1
            if done:
                break
            logits = decode(kv_len_at(n + i), tok[:, None], pos, cache_position, key_mask)
            cache_position.add_(1)
            pos = pos + 1
        new = out[:, :steps]
    return finish(torch.cat([input_ids, new.to(input_ids.dtype)], dim=1), t0)


def _decode_in_place(
    model, token, state, logits, input_ids, position_ids, max_new_tokens, eos, pad_token_id, kv_len_at,
    penalty=None, streamer=None,
):  # fmt: skip
    """Greedy tokens [B, steps] after the prefill's ``logits``, and when the first was ready (after a sync): one
    ``token`` call per token and nothing else.

    "Every row finished?" is read back once per ``_EOS_CHECK_EVERY`` tokens, not every token, so up to that many
    extra steps may run; the result is then trimmed to the step where the last row finished, so it is exactly what
    the per-token loop returns. With a ``streamer`` each token is read back (and the check made) after its step.
    ``penalty``: the repetition penalty, applied in the step on the cache's persistent seen-ids mask."""
    n = position_ids.shape[1]
    eos_t = state.eos(eos)
    state.finished.zero_()
    extra = ()
    if penalty is not None:
        seen = seen_mask(input_ids, logits.shape[-1], out=state.seen(logits.shape[-1]))
        logits = penalize(logits.float(), seen, penalty)
        extra = (seen, penalty)
    first = _greedy(logits, state.finished, eos_t, pad_token_id)
    if penalty is not None:
        mark_seen_(seen, first)
    state.history[:, n] = first
    state.tok.copy_(first[:, None])
    state.pos.copy_(position_ids[:, -1:] + 1)
    state.cache_position.fill_(n)
    model.runtime.mark_step()
    _sync(model)
    t_first = time.perf_counter()
    if streamer is not None:
        streamer.put(first.cpu())
    check_every = 1 if streamer is not None else _EOS_CHECK_EVERY
    args = (state.tok, state.pos, state.cache_position, state.key_mask, state.finished, state.history)
    steps = 1
    done = eos_t is not None and bool(state.finished.all())
    while steps < max_new_tokens and not done:
        token(kv_len_at(n + steps - 1), *args, eos_t, pad_token_id, *extra)  # feeds the token at n + steps - 1
        model.runtime.mark_step()
        steps += 1
        if streamer is not None:
            streamer.put(state.history[:, n + steps - 1].cpu())
        done = eos_t is not None and steps % check_every == 0 and bool(state.finished.all())
    new = state.history[:, n : n + steps]
    if eos_t is not None:
        # A row's first EOS id is where it finished (later ones are pads); the last row to finish ends generation.
        hit = _is_eos(new, eos_t)
        if bool(hit.any(1).all()):
            new = new[:, : int(hit.int().argmax(1).max()) + 1]
    return new, t_first
