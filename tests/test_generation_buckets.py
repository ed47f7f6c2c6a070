"""--bucket_size: the cache is allocated in whole buckets and the attended KV length grows bucket by bucket, so
device graphs (CUDA or HPU) captured per length are reused; without it one static length serves every step."""

import pytest
import torch
import transformers

from polyfuse.generation.kv_cache import bucketed
from polyfuse.generation.steps import forget_steps
from polyfuse.models.llama import LlamaForCausalLM


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=100,
    )  # fmt: skip
    return LlamaForCausalLM.from_config(cfg, seed=3).eval()


@pytest.mark.parametrize(
    "length,bucket,limit,expected",
    [
        (30, -1, 100, 30),
        (30, 0, 100, 30),
        (30, 16, 100, 32),
        (32, 16, 100, 32),
        (33, 16, 100, 48),
        (95, 16, 100, 96),
        (97, 16, 100, 100),
    ],
)
def test_bucketed(length, bucket, limit, expected):
    assert bucketed(length, bucket, limit) == expected


def _kv_lengths(model, monkeypatch, **kw):
    seen = []
    real = type(model).step

    def spy(self, input_ids, position_ids, cache_position, key_mask, kv_len):
        seen.append((input_ids.shape[1], kv_len))
        return real(self, input_ids, position_ids, cache_position, key_mask, kv_len)

    monkeypatch.setattr(type(model), "step", spy)
    forget_steps(model)  # rebuild the step modules around the spy
    out = model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=40, ignore_eos=True, **kw)
    monkeypatch.undo()
    forget_steps(model)
    return out, seen


def test_kv_length_grows_in_buckets(model, monkeypatch):
    plain, seen_plain = _kv_lengths(model, monkeypatch)
    assert seen_plain[0] == (5, 5)  # prefill attends to the prompt only
    assert {kv for n, kv in seen_plain[1:]} == {45}  # one static length: prompt + new tokens
    out, seen = _kv_lengths(model, monkeypatch, bucket_size=16)
    decode = [kv for n, kv in seen[1:]]
    assert model.cache.max_len == 48
    assert sorted(set(decode)) == [16, 32, 48] and decode == sorted(decode)
    assert all(kv >= 5 + i + 1 for i, kv in enumerate(decode))  # every step sees its own position
    assert torch.equal(out, plain), "bucketed decoding changed the greedy tokens"
