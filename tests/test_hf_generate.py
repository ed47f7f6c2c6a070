"""``model.generate`` with transformers' arguments, semantics and defaults, against transformers' own ``generate`` on
the same weights: greedy, sampled (the same seed) and beam tokens equal with ``max_length``, ``min_length``,
``min_new_tokens``, ``no_repeat_ngram_size``, ``bad_words_ids``, a caller's ``logits_processor`` and
``stopping_criteria``; ``return_dict_in_generate`` with the same ``scores`` / ``logits`` / ``sequences_scores``;
defaults from the model's ``generation_config`` (generation_config.json, ``top_k=50`` when sampling) and a passed
config falling back to it; the greedy path that needs processors says so in one log line."""

import logging

import pytest
import torch
import transformers
from helpers import one_thread, perturb_, tiny_config  # noqa: F401
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from polyfuse.models import AutoModelForCausalLM as PfAuto


EOS = 7


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(polyfuse model, transformers model) on the same weights, fp32, eager attention."""
    torch.manual_seed(0)
    hf = perturb_(transformers.LlamaForCausalLM(tiny_config(num_key_value_heads=2)).float())
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    return PfAuto.from_pretrained(str(path)).eval(), hf, str(path)


def prompts():
    ids = torch.tensor([[0, 0, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26]])
    return ids, (ids != 0).long()


def both(pair, seed=None, **kw):
    pf, hf, _ = pair
    ids, mask = prompts()
    out = []
    for m in (pf, hf):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            out.append(m.generate(input_ids=ids, attention_mask=mask, **kw))
    return out


class Ban(LogitsProcessor):
    """A caller's processor: token ``t`` never comes out."""

    def __init__(self, t):
        self.t = t

    def __call__(self, input_ids, scores):
        return scores.index_fill(1, torch.tensor([self.t]), float("-inf"))


class StopOn(StoppingCriteria):
    """A caller's criterion: a row stops once its last token is ``t``."""

    def __init__(self, t):
        self.t = t

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.t


def first_new_tokens(pair, n=8):
    ours, _ = both(pair, max_new_tokens=n, do_sample=False)
    return ours[:, 6:]


@pytest.mark.parametrize(
    "case",
    ["max_length", "min_length", "min_new_tokens", "no_repeat_ngram_size", "bad_words_ids", "processor", "criteria"],
)
def test_greedy_arguments_match_transformers(pair, case):
    free = first_new_tokens(pair)
    common = dict(do_sample=False, pad_token_id=0)
    kw = {
        "max_length": dict(max_length=11),
        # EOS = a token the free run emits early: the min length must hold it back
        "min_length": dict(max_new_tokens=8, eos_token_id=int(free[1, 1]), min_length=11),
        "min_new_tokens": dict(max_new_tokens=8, eos_token_id=int(free[0, 1]), min_new_tokens=5),
        "no_repeat_ngram_size": dict(max_new_tokens=12, no_repeat_ngram_size=1),
        "bad_words_ids": dict(max_new_tokens=8, bad_words_ids=[[int(free[0, 0])], [int(free[1, 2]), int(free[1, 3])]]),
        "processor": dict(max_new_tokens=8, logits_processor=LogitsProcessorList([Ban(int(free[0, 2]))])),
        "criteria": dict(max_new_tokens=8, stopping_criteria=StoppingCriteriaList([StopOn(int(free[0, 3]))])),
    }[case]
    ours, theirs = both(pair, **common, **kw)
    assert torch.equal(ours, theirs), f"{case}:\n{ours}\n{theirs}"
    if case == "max_length":
        assert ours.shape[1] == 11  # prompt included, as in transformers
        return
    plain = {k: v for k, v in kw.items() if k in ("max_new_tokens", "eos_token_id")}
    unchanged = both(pair, **common, **plain)[0]
    assert not torch.equal(ours, unchanged), f"{case} changed nothing: the comparison cannot fail"


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.7), dict(top_k=5, top_p=0.8), dict(top_k=None)])
def test_sampled_tokens_match_transformers_for_the_same_seed(pair, kw):
    ours, theirs = both(pair, seed=3, do_sample=True, max_new_tokens=10, **kw)
    assert torch.equal(ours, theirs)


def test_sampling_defaults_to_top_k_50_from_the_generation_config(pair):
    with_default = both(pair, seed=4, do_sample=True, max_new_tokens=12)[0]
    without = both(pair, seed=4, do_sample=True, max_new_tokens=12, top_k=None)[0]
    assert not torch.equal(with_default, without), "top_k=50 changed nothing on a 301-token vocabulary"


def test_scores_and_logits_match_transformers(pair):
    kw = dict(max_new_tokens=5, return_dict_in_generate=True, output_scores=True, output_logits=True)
    for extra in (dict(do_sample=False, repetition_penalty=1.3), dict(do_sample=True, top_k=7)):
        ours, theirs = both(pair, seed=5, **kw, **extra)
        assert type(ours).__name__ == "GenerateDecoderOnlyOutput"
        assert torch.equal(ours.sequences, theirs.sequences)
        assert len(ours.scores) == len(theirs.scores) == len(ours.logits) == 5
        for a, b in zip(ours.scores + ours.logits, theirs.scores + theirs.logits):
            assert torch.equal(torch.isinf(a), torch.isinf(b))
            torch.testing.assert_close(a[~torch.isinf(a)], b[~torch.isinf(b)], rtol=1e-4, atol=1e-4)


def test_beam_search_output_matches_transformers(pair):
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    ours, theirs = both(pair, **kw, no_repeat_ngram_size=2)
    assert type(ours).__name__ == "GenerateBeamDecoderOnlyOutput"
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(ours.sequences_scores, theirs.sequences_scores, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.beam_indices, theirs.beam_indices)
    assert len(ours.scores) == len(theirs.scores)
    seqs = both(pair, num_beams=3, max_new_tokens=6, stopping_criteria=[StopOn(int(ours.sequences[0, 7]))])
    assert torch.equal(*seqs)


def test_generation_config_json_gives_the_defaults(pair, tmp_path):
    pf, hf, path = pair
    before = pf.generation_config
    pf.generation_config = GenerationConfig.from_model_config(pf.config)
    pf.generation_config.update(do_sample=True, top_k=3, max_new_tokens=7)
    try:
        pf.save_pretrained(tmp_path)
    finally:
        pf.generation_config = before
    assert (tmp_path / "generation_config.json").is_file()
    ours = PfAuto.from_pretrained(str(tmp_path)).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert ours.generation_config.top_k == 3
    ids, mask = prompts()
    runs = []
    for m in (ours, theirs):
        for passed in (None, GenerationConfig(max_new_tokens=4)):  # a passed config falls back to the model's
            torch.manual_seed(6)
            with torch.no_grad():
                runs.append(m.generate(ids, attention_mask=mask, generation_config=passed))
    assert runs[0].shape[1] == 6 + 7 and runs[1].shape[1] == 6 + 4
    assert torch.equal(runs[0], runs[2]) and torch.equal(runs[1], runs[3])


def test_polyfuse_form_and_refusals(pair):
    pf, _, _ = pair
    ids, mask = prompts()
    assert torch.equal(
        pf.generate(ids, mask, max_new_tokens=3), pf.generate(ids, attention_mask=mask, max_new_tokens=3)
    )
    with pytest.raises(TypeError, match="prefix_allowed_tokens_fn"):
        pf.generate(ids, prefix_allowed_tokens_fn=lambda b, s: [1])
    with pytest.raises(ValueError, match="max_time"):
        pf.generate(ids, generation_config=GenerationConfig(max_time=3.0))


def test_greedy_that_needs_processors_says_it_leaves_the_in_place_step(pair, caplog):
    import importlib

    importlib.import_module("polyfuse.generation.generate")._told.clear()  # each reason is logged once per process
    with caplog.at_level(logging.INFO, logger="polyfuse"):
        both(pair, do_sample=False, max_new_tokens=4, no_repeat_ngram_size=2)
        both(pair, do_sample=False, max_new_tokens=4)
    lines = [r.getMessage() for r in caplog.records if "per-token loop" in r.getMessage()]
    assert lines == ["polyfuse generate: greedy decoding runs the per-token loop for no_repeat_ngram_size=2"]
