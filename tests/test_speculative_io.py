"""Speculative decoding at the edges: bad input (one ValueError in the API, one ``error:`` line at the CLI), where
it cannot apply (one warning naming what runs instead), the CLI's flags, Stats and --print_backends, and the HPU
backend on the test double of habana_frameworks (HPU graphs per k, none per accepted length)."""

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import one_thread, write_tiny_cli_model  # noqa: F401  (one_thread: autouse fixture)
from speculative_cases import VOCAB, SpecStats, tiny, write_eagle3

from polyfuse.models import load_eagle3


IDS = torch.tensor([[11, 12, 13, 14, 11, 12, 13]])


@pytest.fixture(scope="module")
def llama():
    return tiny("llama", seed=1)


@pytest.mark.parametrize(
    "kw,needle",
    [
        (
            dict(num_speculative_tokens=0, prompt_lookup_num_tokens=3),
            "num_speculative_tokens must be an integer in 1..32",
        ),
        (dict(prompt_lookup_num_tokens=33), "prompt_lookup_num_tokens must be an integer in 1..32"),
        (dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=0), "max_matching_ngram_size must be"),
        (dict(speculative_method="medusa"), "speculative_method must be one of"),
        (dict(speculative_method="eagle3"), "needs speculative_model"),
        (dict(speculative_method="draft"), "needs assistant_model"),
        (dict(num_speculative_tokens=4), "need a method"),
        (dict(prompt_lookup_num_tokens=3, num_speculative_tokens=4), "give one of them"),
        (dict(assistant_model=42), "assistant_model must be a polyfuse model"),
        (dict(speculative_model="/some/heads"), "generate() takes loaded draft models"),
    ],
)
def test_bad_settings_are_one_line_value_errors(kw, needle):
    from polyfuse.generation import generate

    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
        generate(tiny("llama", seed=1, num_hidden_layers=1), IDS, max_new_tokens=4, **kw)
    assert "\n" not in str(e.value)


def test_draft_and_heads_that_do_not_fit_the_model(llama, tmp_path):
    other_vocab = tiny("llama", seed=2, vocab_size=VOCAB + 1, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocabulary has 129 tokens, the model's 128: a draft model must share"):
        llama.generate(IDS, max_new_tokens=4, assistant_model=other_vocab)
    with pytest.raises(ValueError, match="assistant_model is the model itself"):
        llama.generate(IDS, max_new_tokens=4, assistant_model=llama)
    with pytest.raises(ValueError, match="give assistant_model or speculative_model, not both"):
        llama.generate(IDS, max_new_tokens=4, assistant_model=llama, speculative_model=llama)
    narrow = tiny("llama", seed=3, hidden_size=32)
    path = write_eagle3(tmp_path / "narrow", narrow, layer_ids=[0, 2, 4])
    with pytest.raises(ValueError, match="read hidden states of size 32; the model's hidden size is 64"):
        load_eagle3(path, llama)
    heads = load_eagle3(write_eagle3(tmp_path / "ok", llama, layer_ids=[0, 2, 4]), llama)
    with pytest.raises(ValueError, match="read hidden states of size 64; the model's hidden size is 32"):
        narrow.generate(IDS, max_new_tokens=4, speculative_model=heads)
    deep = write_eagle3(tmp_path / "deep", llama, layer_ids=[0, 2, 9])
    with pytest.raises(ValueError, match=r"layers \[1, 3, 10\] \(inputs\), which a model of 6 layers"):
        llama.generate(IDS, max_new_tokens=4, speculative_model=load_eagle3(deep, llama))
    with pytest.raises(ValueError, match="not an EAGLE-3 checkpoint"):
        tiny("llama", seed=4).save_pretrained(str(tmp_path / "plain"))
        load_eagle3(str(tmp_path / "plain"), llama)


def test_where_speculation_cannot_apply_one_warning_names_what_runs(llama, caplog):
    kw = dict(max_new_tokens=6, ignore_eos=True)
    for extra, needle in ((dict(num_beams=2), "beam search (num_beams=2) runs without speculative decoding"),
                          (dict(use_cache=False), "the cache-less forward runs without speculative decoding")):  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="polyfuse"):
            got = llama.generate(IDS, prompt_lookup_num_tokens=3, **kw, **extra)
        assert torch.equal(got, llama.generate(IDS, **kw, **extra))
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("warning:"), lines


def test_a_generation_config_asks_for_prompt_lookup(llama):
    from transformers import GenerationConfig

    config = GenerationConfig(prompt_lookup_num_tokens=3, max_matching_ngram_size=1, max_new_tokens=8)
    assert torch.equal(llama.generate(IDS, generation_config=config, ignore_eos=True),
                       llama.generate(IDS, max_new_tokens=8, ignore_eos=True))  # fmt: skip


# -- the CLI -----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_models(tmp_path_factory):
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models.builtin import builtin_model

    try:
        tok = load_tokenizer(*builtin_model())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("cli")
    target = write_tiny_cli_model(str(root / "target"), tok, max_position_embeddings=128)
    draft = write_tiny_cli_model(str(root / "draft"), tok, max_position_embeddings=128, seed=1)
    # the same folder with two tokens' ids swapped: another tokenizer of the same size
    other = root / "other_tokenizer"
    other.mkdir()
    for f in Path(draft).iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = [w for w in vocab if w.isalpha() and len(w) > 3][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    return target, draft, str(other)


CLI = ("--device", "cpu", "--warmup", "0", "--n_iterations", "1", "--max_new_tokens", "8", "--prompt",
       "one two three one two three one two")  # fmt: skip


def run_cli(capsys, folder, *argv):
    from polyfuse.cli.generate import main

    rc = main(["--model_name_or_path", folder, *CLI, *(str(a) for a in argv)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def test_cli_runs_each_method_and_reports_it(cli_models, capsys, tmp_path):
    target, draft, _ = cli_models
    rc, out, err = run_cli(capsys, target, "--use_kv_cache", "--prompt_lookup_num_tokens", "3", "--print_backends",
                           "--output_dir", tmp_path)  # fmt: skip
    assert rc == 0, err
    assert "speculative decoding: prompt_lookup (n-gram matching, n <= 2), k=3" in out
    assert "Speculative decoding                = prompt_lookup, k=3" in out
    assert "Draft acceptance rate               = " in out and "Mean tokens per verify step         = " in out
    spec = json.loads((tmp_path / "results.json").read_text())["speculative"]
    assert spec["method"] == "prompt_lookup" and spec["steps"] > 0
    rc, out, err = run_cli(capsys, target, "--use_kv_cache", "--assistant_model", draft, "--num_speculative_tokens",
                           "2", "--print_backends")  # fmt: skip
    assert rc == 0, err
    assert "speculative decoding: draft model" in out and "k=2" in out
    plain = run_cli(capsys, target, "--use_kv_cache", "--print_new_text_only")[1].split("output 1.1: ")[1]
    same = run_cli(capsys, target, "--use_kv_cache", "--print_new_text_only", "--assistant_model", draft)[1]
    assert same.split("output 1.1: ")[1].split("\n")[0] == plain.split("\n")[0]  # greedy: the same text


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ("--num_speculative_tokens", "33", "--prompt_lookup_num_tokens", "3"),
            "--num_speculative_tokens must be an integer in 1..32",
        ),
        (("--prompt_lookup_num_tokens", "0"), "--prompt_lookup_num_tokens must be an integer in 1..32"),
        (("--speculative_method", "eagle3"), "needs speculative_model"),
        (("--speculative_model", "{draft}"), "not an EAGLE-3 checkpoint"),
        (("--assistant_model", "{other}"), "its tokenizer differs from the model's"),
        (("--assistant_model", "/no/such/folder"), "/no/such/folder"),
    ],
)
def test_cli_bad_input_is_one_error_line(cli_models, capsys, argv, needle):
    target, draft, other = cli_models
    argv = [a.format(draft=draft, other=other) for a in argv]
    rc, out, err = run_cli(capsys, target, "--use_kv_cache", *argv)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and needle in errors[0], err


def test_cli_warns_where_speculation_cannot_apply(cli_models, capsys):
    target, draft, _ = cli_models
    rc, out, err = run_cli(capsys, target, "--use_kv_cache", "--num_beams", "2", "--assistant_model", draft)
    assert rc == 0 and err.count("warning:") == 1
    assert "warning: --num_beams 2: beam search runs without speculative decoding (draft)" in err
    rc, out, err = run_cli(capsys, target, "--prompt_lookup_num_tokens", "3")
    assert rc == 0 and "needs --use_kv_cache: the cache-less forward runs without it" in err
    assert "Speculative decoding" not in out


# -- the HPU backend on the test double ---------------------------------------------------------------------------


DOUBLE = Path(__file__).parent / "habana_double"


@pytest.fixture
def habana(monkeypatch):
    """The test double of habana_frameworks in lazy mode, for this test only."""
    from test_hpu_backend import _forget_habana, _import_double

    double = _import_double(monkeypatch, True)
    import habana_frameworks.torch  # noqa: F401  (the double's hpu device)

    yield double
    _forget_habana()


def on_hpu(model, flags):
    """The model moved to the double's HPU, its kernels resolved there for ``flags``."""
    from polyfuse.loader import load as loading

    model.to("hpu")
    model.init_buffers(model.device)
    loading.set_kernels(model, dict(flags))
    model.steps = None
    return model


def graph_keys(module) -> list:
    """Habana's graph-cache key of every call of a module wrapped by wrap_in_hpu_graph (distinct keys = graphs)."""
    from habana_frameworks.torch.hpu.graphs import input_hash

    keys, inner = [], module.forward

    def spy(*args, **kwargs):
        if not kwargs.get("bypass_hpu_graphs"):
            keys.append(input_hash((args, kwargs)))
        return inner(*args, **kwargs)

    module.forward = spy
    return keys


@pytest.mark.parametrize("method", ["prompt_lookup", "draft", "eagle3"])
def test_hpu_graphs_per_k_and_none_per_accepted_length(habana, method, tmp_path):
    """The HPU backend with --use_hpu_graphs (lazy mode): greedy output equal to the native run's; the target's
    module captures one graph per verify width (k + 1; 1 for a prompt-lookup step without a match) plus the prompt,
    and two more generations with other prompts (other accepted lengths) capture nothing new."""
    from polyfuse.generation.steps import model_steps

    flags = {"use_hpu_graphs": True, "use_flash_attention": True}
    native = tiny("llama", seed=1)
    target = on_hpu(tiny("llama", seed=1), flags)
    k = 3
    if method == "prompt_lookup":
        spec = dict(prompt_lookup_num_tokens=k)
    elif method == "draft":
        draft = on_hpu(tiny("llama", seed=1), flags)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            for p in draft.parameters():
                p.add_(torch.randn(p.shape, generator=gen).to(p.device) * 0.004)
        spec = dict(assistant_model=draft, num_assistant_tokens=k)
    else:
        heads = load_eagle3(
            write_eagle3(tmp_path, native, seed=2, layer_ids=[0, 2, 4]), target
        )  # the target's embedding
        spec = dict(speculative_model=on_hpu(heads, flags), num_speculative_tokens=k)
    prompts = [torch.tensor([[11, 12, 13, 14, 11, 12, 13]]), torch.tensor([[20, 21, 22, 20, 21, 22, 20]]),
               torch.tensor([[5, 60, 61, 62, 5, 60, 61]])]  # fmt: skip
    keys = graph_keys(model_steps(target).decode.module)
    accepted = []
    for i, ids in enumerate(prompts):
        stats = SpecStats()
        got = target.generate(ids.to("hpu"), max_new_tokens=20, ignore_eos=True, hooks=stats, **spec)
        assert torch.equal(got.cpu(), native.generate(ids, max_new_tokens=20, ignore_eos=True))
        accepted.append(stats.stats.accepted)
        if i == 0:
            graphs_after_first = len(set(keys))
    assert len(set(keys)) == graphs_after_first  # no new graph for other accepted lengths
    assert graphs_after_first <= 3  # the prompt, k + 1 and (prompt lookup, no match) 1
    names = [c[0] for c in habana.CALLS]
    assert names.count("hpu_graph_capture") == len({*keys}) + (0 if method == "prompt_lookup" else
                                                               3)  # the draft's or heads': prompt, 2 or k + 1, 1  # fmt: skip
    assert names.count("hpu_graph_replay") > 20
    if method == "draft":
        assert sum(accepted) > 0
