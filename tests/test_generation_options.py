"""generate()'s settings (polyfuse.generation.options.GenerationOptions) and phase hooks: a transformers
GenerationConfig gives the same tokens as the same keyword arguments, keywords win over it (None clears a field, as
in transformers), settings polyfuse does not implement are refused, ``max_length`` keeps transformers' meaning; the hooks see start, first token and end in
that order on every decoding path, with the number of new positions."""

import pytest
import torch
from helpers import decode_llama
from transformers import GenerationConfig

from polyfuse.generation.hooks import GenerationHooks
from polyfuse.generation.options import GenerationOptions


@pytest.fixture(scope="module")
def model():
    return decode_llama()


IDS = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
MASK = (IDS != 0).long()


def test_generation_config_gives_the_keywords_tokens(model):
    kw = dict(max_new_tokens=9, do_sample=True, top_k=5, temperature=0.7, repetition_penalty=1.2)
    want = model.generate(IDS, MASK, generator=torch.Generator().manual_seed(2), **kw)
    got = model.generate(
        IDS, MASK, generator=torch.Generator().manual_seed(2), generation_config=GenerationConfig(**kw)
    )
    assert torch.equal(got, want)
    other = model.generate(IDS, MASK, generator=torch.Generator().manual_seed(2), **dict(kw, top_k=40))
    assert not torch.equal(other, want), "top_k changed nothing: the comparison cannot fail"
    # a keyword wins over the config; a keyword given as None clears the field (transformers: top_k=None, no top-k)
    over = model.generate(
        IDS, MASK, generator=torch.Generator().manual_seed(2), generation_config=GenerationConfig(**kw), top_k=40
    )
    assert torch.equal(over, other)
    assert GenerationOptions.from_kwargs(GenerationConfig(top_k=3)).top_k == 3
    assert GenerationOptions.from_kwargs(GenerationConfig(top_k=3), top_k=None).top_k is None
    assert GenerationOptions.from_kwargs().top_k == 50  # transformers' default


def test_max_length_counts_the_prompt(model):
    free = model.generate(IDS, MASK, max_new_tokens=7, ignore_eos=True)
    assert torch.equal(model.generate(IDS, MASK, max_length=12, ignore_eos=True), free)
    cfg = GenerationConfig(max_length=12)
    assert torch.equal(model.generate(IDS, MASK, generation_config=cfg, ignore_eos=True), free)
    assert model.generate(IDS, MASK, max_length=12, max_new_tokens=3, ignore_eos=True).shape == (2, 8)
    assert model.generate(IDS, MASK, ignore_eos=True).shape == (2, 5 + 20)  # polyfuse's default: 20 new tokens
    with pytest.raises(ValueError, match="leaves no room"):
        model.generate(IDS, MASK, max_length=5)


@pytest.mark.parametrize(
    "call, error, needle",
    [
        (dict(output_attentions=True), TypeError, "unexpected keyword argument 'output_attentions'"),
        (dict(timings={}), TypeError, "unexpected keyword argument 'timings'"),
        (dict(generation_config=GenerationConfig(typical_p=0.5)), ValueError, "typical_p"),
        (dict(generation_config=GenerationConfig(num_beams=2, do_sample=True)), ValueError, "beam sampling"),
        (dict(max_length=0), ValueError, "max_length must be an integer >= 1"),
    ],
)
def test_unsupported_settings_are_refused(model, call, error, needle):
    with pytest.raises(error, match=needle) as e:
        model.generate(IDS, MASK, **call)
    assert "\n" not in str(e.value)


def test_options_are_normalized_and_frozen():
    o = GenerationOptions(stop_strings="stop", eos_token_id=3, stop_token_ids=[4, 3], ignore_eos=False)
    assert o.stop_strings == ("stop",) and o.eos_token_id == (3,) and o.eos_ids(None) == [3, 4]
    assert GenerationOptions(ignore_eos=True, stop_token_ids=5).eos_ids(2) == [5]
    assert GenerationOptions().eos_ids([1, 2]) == [1, 2] and GenerationOptions().penalty is None
    with pytest.raises(Exception):
        o.top_k = 3


class Phases(GenerationHooks):
    def __init__(self):
        self.seen = []

    def start(self):
        self.seen.append("start")

    def first_token(self):
        self.seen.append("first")

    def end(self, new_tokens):
        self.seen.append(new_tokens)


@pytest.mark.parametrize(
    "kw",
    [
        {},  # greedy in place
        {"do_sample": True, "top_k": 1},  # the per-token loop
        {"num_beams": 2},
        {"use_cache": False},
        {"use_cache": False, "num_beams": 2},
    ],
)
def test_hooks_see_the_phases_in_order(model, kw):
    hooks = Phases()
    out = model.generate(IDS, MASK, max_new_tokens=6, ignore_eos=True, hooks=hooks, **kw)
    assert hooks.seen == ["start", "first", out.shape[1] - IDS.shape[1]] and out.shape[1] == IDS.shape[1] + 6
