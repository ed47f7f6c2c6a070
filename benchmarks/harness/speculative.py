"""Pieces of benchmarks/benchmark_speculative.py: EAGLE-3 heads with random weights for a target shape (no
download), a forced acceptance of a given mean length, and one timed generate() call."""

from __future__ import annotations

import statistics

import torch
import transformers

from polyfuse.compat import make_config
from polyfuse.distributed.context import SINGLE
from polyfuse.generation.hooks import PhaseTimer
from polyfuse.loader.load import build
from polyfuse.models.eagle3 import Eagle3Head


def random_heads(target, draft_vocab: int = 32000, seed: int = 0) -> Eagle3Head:
    """EAGLE-3 heads of the published Llama-3-8B layout (one layer of the target's width, a draft vocabulary of
    ``draft_vocab``) with random weights, on the target's device and dtype; ``d2t`` a random subset of its vocabulary."""
    cfg = target.config
    config = make_config(
        transformers.LlamaConfig, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=1, num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
    )  # fmt: skip
    config.draft_vocab_size = min(draft_vocab, cfg.vocab_size)
    config.eagle_own_embedding, config.eagle_own_head, config.eagle_fc_bias = False, True, False
    heads = build(Eagle3Head, config, target.dtype, target.device, target.flags, tp=SINGLE)
    gen = torch.Generator(device=heads.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
        hot = torch.randperm(cfg.vocab_size, device="cpu", generator=torch.Generator().manual_seed(seed))
        hot = hot[: config.draft_vocab_size].sort().values.to(heads.device)
        heads.d2t.copy_(hot - torch.arange(config.draft_vocab_size, device=heads.device))
    heads.positions = cfg.max_position_embeddings
    heads.init_buffers(heads.device)
    heads.share(target)
    return heads.eval()


def schedule(mean_tokens: float, k: int):
    """Accepted drafts per step cycling around ``mean_tokens`` - 1 (spread -2..+2, clipped to 0..k): a forced
    acceptance whose mean accepted length (accepted drafts + 1, EAGLE's tau) is ``mean_tokens``."""
    base = mean_tokens - 1
    cycle = [min(max(base + d, 0), k) for d in (-2, -1, 0, 1, 2)]
    shift = base - sum(cycle) / len(cycle)  # clipping moved the mean: put it back on the middle entry
    cycle[2] = min(max(cycle[2] + shift * len(cycle), 0), k)
    whole = [int(round(c)) for c in cycle]
    return lambda step, row: whole[step % len(whole)]


def timed_generate(model, ids, reps: int, **kw) -> dict:
    """Median per-token decode time (after the first token) and end-to-end seconds over ``reps`` calls (after one
    warm-up call: graph captures), the last call's output and speculation stats."""
    model.generate(ids, **kw)
    per_token, e2e, out, timer = [], [], None, None
    for _ in range(reps):
        timer = PhaseTimer(model.runtime)
        out = model.generate(ids, hooks=timer, **kw)
        per_token.append(timer.rest_s / max(timer.new_tokens - 1, 1))
        e2e.append(timer.first_token_s + timer.rest_s)
    return dict(ms_per_token=1e3 * statistics.median(per_token), e2e_s=statistics.median(e2e), out=out,
                stats=timer.speculative, new_tokens=timer.new_tokens)  # fmt: skip
