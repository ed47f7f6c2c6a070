"""Batched generation over the static KV cache: one prefill step, then one decode step per token.

Both steps are ``LlamaForCausalLM.step`` wrapped by the device runtime (``runtime.graph_module``), so CUDA graphs
or HPU graphs replace the step when the run asks for them; everything here is device-agnostic.
"""

from __future__ import annotations

import time
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


def bucketed(length: int, bucket_size: int, limit: int) -> int:
    """Round ``length`` up to a multiple of ``bucket_size`` (no rounding when bucket_size <= 0), at most ``limit``."""
    if bucket_size <= 0:
        return length
    return min(-(-length // bucket_size) * bucket_size, max(limit, length))


def _steppers(model):
    flags = getattr(model, "flags", {})
    cached = getattr(model, "_steppers", None)
    if cached is None or cached[0] is not model.kernels:
        step = StepModule(model)
        runtime = model.runtime
        cached = (
            model.kernels,
            runtime.graph_module(step, "prefill", flags),
            runtime.graph_module(step, "decode", flags),
        )
        model._steppers = cached
    return cached[1], cached[2]


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
    prefill, decode = _steppers(model)
    if model.cache is not old_cache:
        for s in (prefill, decode):
            if hasattr(s, "reset"):
                s.reset()  # captured graphs point at the old cache
    model.model.rotary_emb.update_length(total)
    key_mask = torch.ones(b, model.cache.max_len, dtype=torch.bool, device=device)
    key_mask[:, :n] = mask
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)

    _sync(model)
    t0 = time.perf_counter()
    logits = prefill(n, input_ids, position_ids, torch.arange(n, device=device), key_mask)
    pos = position_ids[:, -1:] + 1
    steps = 0
    cache_positions = torch.arange(n, total, device=device)  # one upload; each step takes a view
    for i in range(max_new_tokens):
        tok, done = emit(i, logits)
        steps = i + 1
        if done:
            break
        p = n + i
        kv_len = bucketed(p + 1, bucket_size, model.cache.max_len) if bucket_size > 0 else model.cache.max_len
        cache_position = cache_positions[i : i + 1]
        logits = decode(kv_len, tok[:, None], pos, cache_position, key_mask)
        pos = pos + 1
    _sync(model)
    t_end = time.perf_counter()
    if timings is not None:
        timings.update(first_token_s=t_first - t0, rest_s=t_end - t_first, new_tokens=steps)
    return torch.cat([input_ids, out[:, :steps]], dim=1)
