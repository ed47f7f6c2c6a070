"""Sampling keeps exactly the tokens transformers' warpers keep (temperature, then top-k, then top-p)."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from polyfuse.generation.sampling import next_token, warp


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, None, None), (0.7, 50, None), (1.3, None, 0.9), (0.8, 20, 0.5)]
)
def test_warp_matches_transformers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 500, generator=g) * 3
    ours = warp(logits, temperature, top_k, top_p)
    ref = logits.clone()
    for w in [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else []):
        ref = w(None, ref)
    if top_p is not None:
        ref = TopPLogitsWarper(top_p)(None, ref)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), "a different set of tokens survives"
    kept = ~torch.isinf(ref)
    torch.testing.assert_close(ours[kept], ref[kept])
    if top_k or top_p:
        assert torch.isinf(ours).any(), "the case filters nothing: it could not catch a wrong filter"


def test_sampling_draws_only_kept_tokens_and_is_reproducible():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(1))
    kept = ~torch.isinf(warp(logits, 1.0, 5, None))
    draws = [next_token(logits, True, 1.0, 5, None, torch.Generator().manual_seed(s)) for s in range(50)]
    assert all(kept.gather(1, d[:, None]).all() for d in draws)
    again = next_token(logits, True, 1.0, 5, None, torch.Generator().manual_seed(7))
    assert torch.equal(again, draws[7])
    assert len({tuple(d.tolist()) for d in draws}) > 1, "sampling never varied"
