"""polyfuse.generation.CachedStep, the one-step interface for other engines (speculative decoding, serving): the
logits of the last n positions of a cached step equal the cache-less forward's at those positions (float32 noise),
for a prompt step and for a k + 1 token verification step after it, with left padding, KV buckets, a sliding window,
and through (faked) CUDA graphs; the default keeps returning the last position's logits only."""

import pytest
import torch
import transformers
from helpers import PAD, Recorded, fake_cuda_graphs, left_padded, one_thread, perturb_, random_rows  # noqa: F401

from polyfuse.backends.cuda.graphs import GraphedStep
from polyfuse.core.runtime import Step
from polyfuse.generation import CachedStep
from polyfuse.generation.steps import forget_steps
from polyfuse.models import LlamaForCausalLM, MistralForCausalLM


VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {
    "llama": (transformers.LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, MistralForCausalLM, {"sliding_window": 5}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    cfg_cls, model_cls, extra = FAMILIES[request.param]
    return perturb_(model_cls.from_config(cfg_cls(**COMMON, **extra), seed=7), 7).eval()


@pytest.fixture(autouse=True)
def fresh(model):
    forget_steps(model)
    model.cache = None
    yield
    forget_steps(model)


def positions(mask):
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


@torch.inference_mode()
def forward_logits(model, ids, mask):
    return model(ids, attention_mask=mask, position_ids=positions(mask)).logits


def close(got, want):
    return (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


SEQS = random_rows((14, 9, 11), VOCAB, seed=3)  # left-padded to 14; the last 4 of each row are the "draft"


@torch.inference_mode()
@pytest.mark.parametrize("bucket", [-1, 8])
def test_verify_step_logits_equal_the_forward(model, bucket):
    ids, mask = left_padded(SEQS)
    rows, total = ids.shape
    n, k1 = total - 4, 4  # prompt, then k + 1 = 4 positions verified in one step
    want = forward_logits(model, ids, mask)
    prompt, verify = CachedStep(model, "prefill"), CachedStep(model)
    prompt.reserve(rows, total + 8, bucket_size=bucket)
    max_len = model.cache.max_len
    key_mask = torch.ones(rows, max_len, dtype=torch.bool)
    key_mask[:, :total] = mask.bool()
    pos = positions(mask)
    last = prompt(ids[:, :n], pos[:, :n], torch.arange(n), key_mask, n)  # the default: the last position, pruned
    assert last.shape == (rows, VOCAB) and close(last, want[:, n - 1])
    kv_len = total if bucket <= 0 else -(-total // bucket) * bucket
    got = verify(ids[:, n:], pos[:, n:], torch.arange(n, total), key_mask, kv_len, logits_to_keep=k1)
    assert got.shape == (rows, k1, VOCAB) and close(got, want[:, n:])
    # the cache holds what the steps wrote: the same verification again reads the same keys
    again = verify(ids[:, n:], pos[:, n:], torch.arange(n, total), key_mask, max_len, logits_to_keep=2)
    assert again.shape == (rows, 2, VOCAB) and close(again, want[:, -2:])


@torch.inference_mode()
def test_prompt_step_every_position(model):
    """logits_to_keep=0: every position of a prompt step, as transformers' logits_to_keep=0 (no padding, no mask)."""
    ids = torch.tensor(random_rows((12, 12), VOCAB, seed=4))
    mask = torch.ones_like(ids)
    step = CachedStep(model, "prefill")
    step.reserve(*ids.shape)
    got = step(ids, positions(mask), torch.arange(12), logits_to_keep=0)
    assert got.shape == (2, 12, VOCAB) and close(got, forward_logits(model, ids, mask))
    one = step(ids, positions(mask), torch.arange(12), logits_to_keep=1)
    assert close(one[:, 0], step(ids, positions(mask), torch.arange(12)))


@torch.inference_mode()
def test_default_key_mask_past_the_prompt(model):
    """Without a key mask a step past slot 0 attends by slot (every key real, causality from cache_position)."""
    ids = torch.tensor(random_rows((13,), VOCAB, seed=6))
    mask = torch.ones_like(ids)
    step = CachedStep(model)
    step.reserve(1, 32)
    step(ids[:, :9], positions(mask)[:, :9], torch.arange(9))  # the whole cache attended: only the slots limit it
    got = step(ids[:, 9:], positions(mask)[:, 9:], torch.arange(9, 13), logits_to_keep=4)
    want = forward_logits(model, ids, mask)[:, 9:]
    assert close(got, want)
    wrong = step(ids[:, 9:], positions(mask)[:, 9:] + 1, torch.arange(9, 13), logits_to_keep=4)  # shifted rope
    assert not close(wrong, want), "the comparison cannot tell positions apart"


@torch.inference_mode()
def test_verify_step_through_cuda_graphs(model, monkeypatch):
    """The decode wrapper of model.steps (what generate() replays) graphs a k + 1 step too: one capture per
    (kv_len, shapes, logits_to_keep), replays with new inputs give the eager logits."""
    fake_cuda_graphs(monkeypatch)
    made = []

    def graph_module(module, phase, flags):
        if phase != "decode":
            return Step(module)
        made.append(GraphedStep(Recorded(module, inplace=False)))
        return made[-1]

    monkeypatch.setattr(model.runtime, "graph_module", graph_module)
    ids, mask = left_padded(SEQS)
    rows, total = ids.shape
    want = forward_logits(model, ids, mask)
    step = CachedStep(model)
    step.reserve(rows, 16)
    key_mask = torch.ones(rows, 16, dtype=torch.bool)
    key_mask[:, :total] = mask.bool()
    pos = positions(mask)
    for start in (0, 4, 8):  # three 4-token steps through one graph
        sl = slice(start, start + 4)
        got = step(ids[:, sl], pos[:, sl], torch.arange(start, start + 4), key_mask, 16, logits_to_keep=4)
        real = mask[:, sl].bool()  # padding slots' queries see no key: their logits mean nothing
        assert close(got[real], want[:, sl][real]), start
    (graphed,) = made
    assert graphed.disabled_reason is None and len(graphed.graphs) == 1 and graphed.fn.runs == 2  # warm-ups only
    (key,) = graphed.graphs
    assert key[0] == 16 and key[-1] == 4  # kv_len and logits_to_keep are constants of the graph


def test_bad_uses_are_one_line_errors(model):
    with pytest.raises(ValueError, match="phase must be"):
        CachedStep(model, "token")
    with pytest.raises(ValueError, match="reserve"):
        CachedStep(model)(torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([0]))
