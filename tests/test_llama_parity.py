"""Parity of polyfuse's Llama with transformers' eager fp32 Llama on the same weights: logits (max abs diff <= 1e-4)
and greedy generation (token-identical), on the built-in SmolLM2 GGUF and on small random configs in both checkpoint
directions (polyfuse save -> HF load, HF save -> polyfuse load, sharded either way). Plus generate()'s contract:
reproducible sampling, argument validation, cache/bucket invariance."""

import glob
import os

import pytest
import torch
from helpers import (
    EOS,
    PAD,
    assert_same_generation,
    hf_from_pretrained,
    hf_random,
    left_padded,
    logits_diff,
    one_thread,  # noqa: F401  (autouse fixture)
    perturb_,
    positions,
    random_rows,
    tiny_config,
)

from polyfuse.compat import rope_parameters
from polyfuse.loader.save import save_pretrained
from polyfuse.models.llama import LlamaForCausalLM


ATOL = 1e-4

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CONFIGS = {
    "mha": {},
    "gqa": {"num_attention_heads": 8, "num_key_value_heads": 2},
    "mqa_tied": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "llama3_rope": {"num_attention_heads": 8, "num_key_value_heads": 2, "rope_parameters": LLAMA3},
    "linear_rope": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    # max_position_embeddings 16 so the 24-token forward below exercises the dynamic NTK growth of the base.
    "dynamic_rope": {
        "max_position_embeddings": 16,
        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    },
    "odd_sizes_bias_tied": {
        "hidden_size": 72,
        "intermediate_size": 100,
        "vocab_size": 301,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,  # != 72 / 6
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
    },
}

# Prompt lengths of the padded batch: row 0 unpadded, rows 1 and 2 left-padded.
LENGTHS = (24, 19, 9)


def check_logits(ours, hf, config, seed=0):
    rows = random_rows(LENGTHS, config.vocab_size, seed)
    single = torch.tensor([rows[0]])
    assert logits_diff(ours, hf, single) <= ATOL
    ids, mask = left_padded(rows)
    assert logits_diff(ours, hf, ids, mask) <= ATOL
    if rope_parameters(config).get("rope_type") == "dynamic":
        return  # dynamic NTK depends on the batch's length (as in HF), so a row alone legitimately differs
    # Left padding must not change a row's logits: compare the most padded row against itself alone.
    with torch.no_grad():
        alone = ours(torch.tensor([rows[2]])).logits[0]
        padded = ours(ids, attention_mask=mask, position_ids=positions(mask)).logits[2]
    assert (padded[-len(rows[2]) :] - alone).abs().max().item() <= ATOL


# -- random configs, both checkpoint directions -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ours_saved_loads_in_hf_with_same_logits(name, tmp_path):
    cfg = tiny_config(**CONFIGS[name])
    ours = perturb_(LlamaForCausalLM.from_config(cfg, seed=1), seed=1).eval()
    ours.save_pretrained(str(tmp_path))
    assert os.path.isfile(tmp_path / "model.safetensors")
    hf = hf_from_pretrained(str(tmp_path))
    assert hf.config.tie_word_embeddings == cfg.tie_word_embeddings
    check_logits(ours, hf, cfg)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_saved_loads_in_ours_with_same_logits(name, tmp_path):
    cfg = tiny_config(**CONFIGS[name])
    hf = hf_random(cfg, seed=2)
    hf.save_pretrained(str(tmp_path))
    ours = LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    check_logits(ours, hf, cfg, seed=3)


def test_sharded_checkpoints_both_ways(tmp_path):
    cfg = tiny_config(**CONFIGS["gqa"])
    hf = hf_random(cfg, seed=4)
    hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="200KB")
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")
    assert len(glob.glob(str(tmp_path / "hf" / "*.safetensors"))) > 1
    ours = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    check_logits(ours, hf, cfg)

    save_pretrained(ours, str(tmp_path / "ours"), max_shard_bytes=100_000)
    assert os.path.isfile(tmp_path / "ours" / "model.safetensors.index.json")
    assert len(glob.glob(str(tmp_path / "ours" / "*.safetensors"))) > 1
    check_logits(ours, hf_from_pretrained(str(tmp_path / "ours")), cfg)
    again = LlamaForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
    ids = torch.tensor(random_rows([12], cfg.vocab_size))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours(ids).logits)


# -- greedy generation on random configs ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gen_pair(tmp_path_factory):
    """A GQA llama3-rope model in both implementations (from one checkpoint), shared by the generate() tests."""
    cfg = tiny_config(**CONFIGS["llama3_rope"], initializer_range=0.1)
    ours = perturb_(LlamaForCausalLM.from_config(cfg, seed=5), seed=5).eval()
    path = str(tmp_path_factory.mktemp("gen_pair"))
    ours.save_pretrained(path)
    return ours, hf_from_pretrained(path), cfg


def hf_generate(hf, ids, mask, n, eos=EOS, pad=PAD):
    with torch.no_grad():
        return hf.generate(
            ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=pad
        )


@pytest.mark.parametrize("name", ["gqa", "mqa_tied", "odd_sizes_bias_tied", "llama3_rope"])
def test_greedy_generation_matches_hf_random(name, tmp_path):
    cfg = tiny_config(**CONFIGS[name], initializer_range=0.1)
    if name == "llama3_rope":
        cfg.max_position_embeddings = 128
    ours = perturb_(LlamaForCausalLM.from_config(cfg, seed=6), seed=6).eval()
    ours.save_pretrained(str(tmp_path))
    hf = hf_from_pretrained(str(tmp_path))
    rows = random_rows((11, 6, 3), cfg.vocab_size, seed=7)
    # Single prompt, then the batch left-padded. EOS id 7 is a common enough token to end some rows early.
    single = torch.tensor([rows[0]])
    assert_same_generation(ours.generate(single, max_new_tokens=40), hf_generate(hf, single, None, 40), 11, EOS, PAD)
    ids, mask = left_padded(rows)
    out = ours.generate(ids, mask, max_new_tokens=40, eos_token_id=EOS, pad_token_id=PAD)
    assert out.shape[1] >= ids.shape[1] + 32 or all(EOS in r for r in out[:, ids.shape[1] :].tolist())
    assert_same_generation(out, hf_generate(hf, ids, mask, 40), ids.shape[1], EOS, PAD)


def test_eos_stops_rows_and_pads(gen_pair):
    ours, hf, cfg = gen_pair
    rows = random_rows((8, 5), cfg.vocab_size, seed=8)
    ids, mask = left_padded(rows)
    free = ours.generate(ids, mask, max_new_tokens=12, ignore_eos=True)
    assert free.shape == (2, ids.shape[1] + 12)
    # Declare the 3rd new token of row 0 the EOS: row 0 stops at its first occurrence and is padded afterwards.
    n = ids.shape[1]
    eos = int(free[0, n + 2])
    k = free[0, n:].tolist().index(eos)
    out = ours.generate(ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD)
    theirs = hf_generate(hf, ids, mask, 12, eos=eos)
    assert out.shape == theirs.shape
    assert_same_generation(out, theirs, n, eos, PAD)
    assert torch.equal(out[0, : n + k + 1], free[0, : n + k + 1])
    assert (out[0, n + k + 1 :] == PAD).all()


def test_sampling_is_reproducible_with_a_generator(gen_pair):
    ours, _, cfg = gen_pair
    ids, mask = left_padded(random_rows((6, 4), cfg.vocab_size, seed=9))
    kw = {"max_new_tokens": 16, "do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 0.95, "ignore_eos": True}
    a = ours.generate(ids, mask, generator=torch.Generator().manual_seed(123), **kw)
    b = ours.generate(ids, mask, generator=torch.Generator().manual_seed(123), **kw)
    c = ours.generate(ids, mask, generator=torch.Generator().manual_seed(321), **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # top_k=1 sampling is greedy decoding.
    greedy = ours.generate(ids, mask, max_new_tokens=16, ignore_eos=True)
    k1 = ours.generate(ids, mask, max_new_tokens=16, ignore_eos=True, do_sample=True, top_k=1)
    assert torch.equal(greedy, k1)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_generate_rejects_bad_arguments(gen_pair, kw, match):
    ours = gen_pair[0]
    args = {"max_new_tokens": 4, "do_sample": True, **kw}
    with pytest.raises(ValueError, match=match):
        ours.generate(torch.tensor([[11, 12, 13]]), **args)


def test_generate_rejects_prompt_past_max_positions(gen_pair):
    ours, _, cfg = gen_pair
    n = cfg.max_position_embeddings - 10
    ids = torch.full((1, n), 11)
    with pytest.raises(ValueError) as e:
        ours.generate(ids, max_new_tokens=20)
    msg = str(e.value)
    assert str(n) in msg and "20" in msg and str(cfg.max_position_embeddings) in msg
    assert ours.generate(ids, max_new_tokens=10, ignore_eos=True).shape == (1, cfg.max_position_embeddings)


def test_no_cache_and_buckets_give_same_greedy_tokens(gen_pair):
    ours, _, cfg = gen_pair
    ids, mask = left_padded(random_rows((9, 4, 6), cfg.vocab_size, seed=10))
    kw = {"max_new_tokens": 33, "eos_token_id": EOS, "pad_token_id": PAD}
    ref = ours.generate(ids, mask, use_cache=True, **kw)
    assert torch.equal(ours.generate(ids, mask, use_cache=False, **kw), ref)
    for bucket in (8, 16):
        assert torch.equal(ours.generate(ids, mask, bucket_size=bucket, **kw), ref)
    # A different batch size after bucketed runs (re-allocated cache) still agrees with a fresh single-row run.
    single = ours.generate(ids[:1], mask[:1], use_cache=True, **kw)
    assert torch.equal(single[0, : ref.shape[1]], ref[0, : single.shape[1]])


# -- the built-in model (SmolLM2-135M-Instruct, Q4_1 GGUF) --------------------------------------------------------


@pytest.fixture(scope="module")
def builtin():
    """polyfuse and transformers each dequantize the same GGUF; loaded once per module (the slow part)."""
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models.builtin import builtin_model

    try:
        folder, name = builtin_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    ours = LlamaForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    hf = hf_from_pretrained(folder, gguf_file=name)
    return ours, hf, load_tokenizer(folder, name)


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers:",
]


def chat(tok, prompts):
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask


@pytest.mark.slow
def test_builtin_logits_match_hf(builtin):
    ours, hf, tok = builtin
    ids, mask = chat(tok, PROMPTS)
    assert not mask.all(), "the prompts should need left padding"
    assert logits_diff(ours, hf, ids, mask) <= ATOL
    single = tok("DeepSpeed is a machine learning framework", return_tensors="pt").input_ids
    assert logits_diff(ours, hf, single) <= ATOL


@pytest.mark.slow
def test_builtin_greedy_generation_matches_hf(builtin):
    ours, hf, tok = builtin
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ids, mask = chat(tok, PROMPTS)
    out = ours.generate(ids, mask, max_new_tokens=32, eos_token_id=eos, pad_token_id=pad)
    assert_same_generation(out, hf_generate(hf, ids, mask, 32, eos=eos, pad=pad), ids.shape[1], eos, pad)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    # A plain single prompt (no padding, no template) that runs the full 32 tokens.
    single = tok("The history of the Roman Empire", return_tensors="pt").input_ids
    out = ours.generate(single, max_new_tokens=32, eos_token_id=eos, pad_token_id=pad)
    theirs = hf_generate(hf, single, None, 32, eos=eos, pad=pad)
    assert_same_generation(out, theirs, single.shape[1], eos, pad)
