"""Perplexity of a causal LM over a text: the quality check of quantized weights (benchmarks/evaluate_perplexity.py,
tests/test_quantization.py)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F


def token_windows(ids: torch.Tensor, context: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """1-D token ids -> non-overlapping windows of ``context`` tokens (the last one shorter), at most ``max_tokens``
    tokens in all (0: every token)."""
    if max_tokens > 0:
        ids = ids[:max_tokens]
    return [ids[i : i + context] for i in range(0, len(ids), context) if len(ids[i : i + context]) > 1]


@torch.inference_mode()
def perplexity(model, windows: list[torch.Tensor], device=None) -> tuple[float, int]:
    """(exp(mean negative log-likelihood), tokens scored) over the windows: each window is one cache-less forward
    scoring its tokens after the first (the model's fused linear cross-entropy: no [tokens, vocab] logits kept)."""
    device = device or model.device
    nll, count = 0.0, 0
    for w in windows:
        ids = w[None].to(device)
        loss = model(ids, labels=ids).loss
        nll += float(loss) * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    return math.exp(nll / count), count


@torch.inference_mode()
def token_nll(model, windows: list[torch.Tensor], device=None) -> torch.Tensor:
    """Each scored token's negative log-likelihood (float32, on the CPU, in the windows' order; the tokens
    ``perplexity`` scores). Comparing two runs token by token tells apart a change that moves many tokens by a
    little from one whose perplexity moves by chance: with ~1000 tokens, perplexity's standard error is about
    std(per-token change) / sqrt(tokens)."""
    device = device or model.device
    out = []
    for w in windows:
        ids = w[None].to(device)
        logits = model(ids).logits[0, :-1].float()
        out.append(F.cross_entropy(logits, ids[0, 1:], reduction="none").cpu())
    return torch.cat(out)


# The relative noise ``jittered_inputs`` puts on each input embedding value: about one bf16 step (2^-8 = 0.0039).
JITTER = 0.004


@contextlib.contextmanager
def jittered_inputs(model, seed: int, scale: float = JITTER):
    """Within the block, every value the model's input embedding gives is multiplied by (1 + scale * n), n standard
    normal, and rounded back to its dtype: a perturbation at the level of bf16's own rounding, which a quantized
    format's perplexity should not notice, but which rounded activations (fp8's W8A8, int8 activations) turn into
    whole rounding steps. Scoring the same windows under a few seeds samples that noise (docs/quantization.md,
    "Quality"). The draws come from a CPU generator seeded with ``seed``, in call order: two models scored over
    the same windows in the same order get the same draws, whatever their device."""
    gen = torch.Generator().manual_seed(seed)

    def hook(module, args, out):
        n = torch.randn(out.shape, generator=gen, dtype=torch.float32).to(out.device)
        return (out.float() * (1.0 + scale * n)).to(out.dtype)

    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
