"""optimum-habana run_generation.py flags on the generation side, end to end on a tiny random Llama with the built-in
tokenizer, each against a reference computed without polyfuse's CLI: transformers' generate on the same weights (the
data-set batches as optimum-habana forms them, the PEFT adapter merged by PEFT on transformers, bad_words_ids, the
prompt columns optimum-habana's adjust_batch makes), and the files written read back."""

import json
import os

import pytest
import torch
import transformers
from helpers import builtin_tokenizer, one_thread, write_tiny_cli_model  # noqa: F401  (one_thread: autouse fixture)

from polyfuse.cli.dyn_prompt import adjust_batch, timed_lengths, warmup_plan
from polyfuse.cli.generate import main
from polyfuse.cli.generation_options import bad_words_ids


FAST = ("--device", "cpu", "--warmup", "0", "--n_iterations", "1", "--max_new_tokens", "4")
TEXTS = [
    "The river runs past the old mill and on towards the sea, where the boats wait for the tide to turn again",
    "A short one",
    "Cats sleep most of the day",
    "Every morning the baker opens the shop before the sun is up",
    "Seven",
]


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer):
    return write_tiny_cli_model(str(tmp_path_factory.mktemp("tiny")), tokenizer, max_position_embeddings=64)


@pytest.fixture(scope="module")
def hf(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    model.set_attn_implementation("eager")
    return model


def run_main(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error(rc, err):
    assert rc != 0 and "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


def hf_greedy(hf, ids, mask, n=4, **kw):
    """transformers' greedy tokens, past EOS (polyfuse-generate's --ignore_eos default)."""
    with torch.no_grad():
        return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, **kw)  # fmt: skip


def results(path):
    return json.loads((path / "results.json").read_text(encoding="utf-8"))


# -- --dataset_name ------------------------------------------------------------------------------------------------


def write_jsonl(path, texts):
    path.write_text("\n".join(json.dumps({"n": i, "text": t}) for i, t in enumerate(texts)), encoding="utf-8")
    return path


def test_dataset_batches_tokens_and_output_lines(capsys, folder, tokenizer, hf, tmp_path):
    """A local data file: shuffled with --seed, the first --dataset_max_samples rows, the first string column, each
    prompt cut to its first 16 tokens (--max_input_tokens 0), batches of 2; the greedy tokens of every batch equal
    transformers' on those batches, and results.json and the Batch / Stats lines say what ran."""
    import datasets

    data = write_jsonl(tmp_path / "prompts.jsonl", TEXTS)
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, "--warmup", "1", "--dataset_name", data,
                            "--dataset_max_samples", "3", "--batch_size", "2", "--output_dir", tmp_path / "o")  # fmt: skip
    assert rc == 0, err
    rows = datasets.load_dataset("json", data_files=str(data))["train"].shuffle(seed=27).select(range(3))["text"]
    want = []
    tokenizer.truncation_side = "right"
    for batch in (rows[:2], rows[2:]):
        enc = tokenizer(batch, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
        want += tokenizer.batch_decode(hf_greedy(hf, enc.input_ids, enc.attention_mask), skip_special_tokens=True)
    tokenizer.truncation_side = "left"
    r = results(tmp_path / "o")
    assert r["output"] == want
    assert r["dataset"] == {"name": str(data), "split": "train", "column": "text", "rows": 3, "batches_timed": 2}
    assert TEXTS[0] in rows  # the long prompt ran, its first 16 tokens kept (not its last)
    (cut,) = [i for i in r["input"] if i.startswith("The river")]
    assert len(tokenizer(cut).input_ids) <= 16 and not cut.endswith("again")
    assert "Batch n°1" in out and "Batch n°2" in out and "Batch n°3" not in out
    assert "Throughput (including tokenization) = " in out and "Total runtime for dataset: " in out
    assert r["throughput"] > 0 and r["total_runtime_for_dataset"] > 0
    assert "choosing 'text'" in err


def test_dataset_folder_saved_dataset_and_partial_run(capsys, folder, tokenizer, hf, tmp_path):
    """A save_to_disk folder with a test split (taken before train), --column_name, whole prompts
    (--max_input_tokens -1, left-padded per batch) and --run_partial_dataset stopping after --n_iterations batches."""
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"q": ["never used"] * 2, "n": [0, 1]}),
        "test": datasets.Dataset.from_dict({"q": TEXTS, "n": list(range(len(TEXTS)))}),
    }).save_to_disk(str(saved))  # fmt: skip
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, "--dataset_name", saved, "--column_name",
                            "q", "--max_input_tokens", "-1", "--batch_size", "2", "--run_partial_dataset",
                            "--output_dir", tmp_path / "o")  # fmt: skip
    assert rc == 0, err
    rows = datasets.load_from_disk(str(saved))["test"].shuffle(seed=27)["q"]
    enc = tokenizer(rows[:2], padding=True, return_tensors="pt")
    want = tokenizer.batch_decode(hf_greedy(hf, enc.input_ids, enc.attention_mask), skip_special_tokens=True)
    r = results(tmp_path / "o")
    assert r["output"] == want and r["input"] == rows[:2]
    assert r["dataset"]["split"] == "test" and r["dataset"]["batches_timed"] == 1
    assert "Batch n°2" not in out


@pytest.mark.parametrize(
    "extra, needle",
    [
        (("--dataset_name", "no/such_dataset_here"), "--dataset_name no/such_dataset_here"),
        (("--dataset_name", "DATA", "--column_name", "nope"), "--column_name nope: no such column"),
        (("--dataset_name", "DATA", "--prompt", "hi"), "--dataset_name and --prompt: give one of them"),
        (("--dataset_name", "DATA", "--simulate_dyn_prompt", "4"), "--simulate_dyn_prompt"),
        (("--dataset_name", "mlcommons"), "MLCommons"),
    ],
    ids=["missing", "column", "prompt", "dyn-prompt", "mlcommons"],
)
def test_dataset_bad_input_is_one_line(capsys, folder, tmp_path, extra, needle):
    data = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    argv = [str(data) if a == "DATA" else a for a in extra]
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, *argv)
    assert needle in one_error(rc, err)


# -- --peft_model --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter(folder, tmp_path_factory):
    """A LoRA adapter of the tiny model made by PEFT on transformers (random A and B: it changes the output)."""
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=16, init_lora_weights=False, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])  # fmt: skip
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)  # large enough that the greedy tokens move
    path = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(path)
    return path


def merged_by_peft(folder, adapter):
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
    model = peft.PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
    model.set_attn_implementation("eager")
    return model


PROMPT = "The capital of France is"


def test_peft_model_output_is_the_peft_merged_models(capsys, folder, adapter, tokenizer, hf, tmp_path):
    """--peft_model alone: the adapter's recorded base is loaded, the adapter merged; the greedy tokens are those of
    transformers' model with the adapter merged by PEFT, and not those of the bare model."""
    rc, out, err = run_main(capsys, "--peft_model", adapter, *FAST, "--max_new_tokens", "6", "--prompt", PROMPT,
                            "--output_dir", tmp_path)  # fmt: skip
    assert rc == 0, err
    assert not [x for x in err.splitlines() if x.startswith("warning:")], err
    enc = tokenizer([PROMPT], return_tensors="pt")
    want = merged_by_peft(folder, adapter)
    got = results(tmp_path)
    assert got["output"] == tokenizer.batch_decode(hf_greedy(want, enc.input_ids, enc.attention_mask, 6),
                                                   skip_special_tokens=True)  # fmt: skip
    bare = tokenizer.batch_decode(hf_greedy(hf, enc.input_ids, enc.attention_mask, 6), skip_special_tokens=True)
    assert got["output"] != bare, "the adapter changed nothing: the test would pass without it"
    assert got["args"]["model_name_or_path"] == folder


def test_peft_model_falls_back_to_model_name_or_path(capsys, folder, adapter, tokenizer, tmp_path):
    """An adapter whose recorded base is nowhere: --model_name_or_path is its base, with one warning."""
    moved = tmp_path / "adapter"
    moved.mkdir()
    for name in os.listdir(adapter):
        (moved / name).write_bytes((adapter / name).read_bytes())
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, "--peft_model", moved, *FAST, "--prompt", PROMPT,
                            "--output_dir", tmp_path / "o")  # fmt: skip
    assert rc == 0, err
    (warning,) = [x for x in err.splitlines() if x.startswith("warning:")]
    assert "gone" in warning and f"--model_name_or_path {folder}" in warning
    enc = tokenizer([PROMPT], return_tensors="pt")
    want = tokenizer.batch_decode(hf_greedy(merged_by_peft(folder, adapter), enc.input_ids, enc.attention_mask),
                                  skip_special_tokens=True)  # fmt: skip
    assert results(tmp_path / "o")["output"] == want


def test_peft_model_refusals(capsys, folder, adapter, tmp_path):
    rc, out, err = run_main(capsys, "--peft_model", adapter, *FAST, "--quant", "int8")
    assert "--peft_model with --quant int8" in one_error(rc, err)
    rc, out, err = run_main(capsys, "--peft_model", tmp_path / "nothing", *FAST)
    assert "not a PEFT adapter" in one_error(rc, err)


# -- --bad_words ---------------------------------------------------------------------------------------------------


def test_bad_words_ids_ban_the_word_with_and_without_its_space(tokenizer):
    ids = bad_words_ids(tokenizer, ["Paris"])
    assert tokenizer.encode(" Paris", add_special_tokens=False) in ids
    assert tokenizer.encode("Paris", add_special_tokens=False) in ids
    assert bad_words_ids(tokenizer, None) is None
    with pytest.raises(ValueError, match="no text"):
        bad_words_ids(tokenizer, [" "])


def test_bad_words_are_never_generated(capsys, folder, tokenizer, hf, tmp_path):
    """The word the model generates first is banned: it is gone, and the tokens are transformers' with the same
    bad_words_ids."""
    enc = tokenizer([PROMPT], return_tensors="pt")
    free = hf_greedy(hf, enc.input_ids, enc.attention_mask)[0, enc.input_ids.shape[1] :]
    word = tokenizer.decode(free[:1]).strip()
    assert word, "the first token is no word to ban"
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, "--prompt", PROMPT, "--bad_words", word,
                            "--output_dir", tmp_path)  # fmt: skip
    assert rc == 0, err
    banned = bad_words_ids(tokenizer, [word])
    want = hf_greedy(hf, enc.input_ids, enc.attention_mask, bad_words_ids=banned)
    assert results(tmp_path)["output"] == tokenizer.batch_decode(want, skip_special_tokens=True)
    new = want[0, enc.input_ids.shape[1] :].tolist()
    assert int(free[0]) not in new and [int(free[0])] in banned


def test_force_words_stays_refused_with_its_reason(capsys, folder):
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, "--force_words", "Paris")
    assert "constrained beam search" in one_error(rc, err)


# -- --simulate_dyn_prompt -----------------------------------------------------------------------------------------


def test_adjust_batch_cuts_or_stretches_as_optimum_habana():
    ids, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    cut = adjust_batch(ids, mask, 2)
    assert cut[0].tolist() == [[0, 5], [7, 8]] and cut[1].tolist() == [[0, 1], [1, 1]]
    wide = adjust_batch(ids, mask, 5)
    assert wide[0].tolist() == [[0, 5, 6, 6, 6], [7, 8, 9, 9, 9]]
    assert wide[1].tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_dyn_prompt_plans():
    assert [s for _, s in warmup_plan(None, 2, 8)] == [None, None]
    assert warmup_plan([5, 5], 2, 8) == [("Warming up for shape 5 iteration 1/2", 5),
                                         ("Warming up for shape 5 iteration 2/2", 5)]  # fmt: skip
    assert [s for _, s in warmup_plan([5, 20, 9], 1, 8)] == [23, 15, 7]  # every bucket, the longest first
    assert warmup_plan([5, 9], 3, -1) == []  # several lengths without buckets: no warm-up (optimum-habana's)
    assert timed_lengths([5, 9], 3) == [5, 9, 5] and timed_lengths(None, 2) == [None, None]


def test_simulate_dyn_prompt_end_to_end(capsys, folder, tokenizer, hf, tmp_path):
    """Warm-up over the buckets of the lengths, then one length per timed run: the last run's tokens are
    transformers' on the prompt columns adjust_batch gave for its length."""
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, "--prompt", PROMPT, "--warmup", "1",
                            "--n_iterations", "2", "--simulate_dyn_prompt", "3", "10", "--bucket_size", "8",
                            "--output_dir", tmp_path)  # fmt: skip
    assert rc == 0, err
    lines = out.splitlines()
    assert lines.index("Warming up for shape 15 iteration 1/1") < lines.index("Warming up for shape 7 iteration 1/1")
    assert lines.index("Generating for shape, 3") < lines.index("Generating for shape, 10")
    enc = tokenizer([PROMPT], return_tensors="pt")
    ids, mask = adjust_batch(enc.input_ids, enc.attention_mask, 10)
    assert ids.shape[1] == 10 and enc.input_ids.shape[1] < 10
    want = tokenizer.batch_decode(hf_greedy(hf, ids, mask), skip_special_tokens=True)
    assert results(tmp_path)["output"] == want


def test_simulate_dyn_prompt_bad_lengths(capsys, folder):
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, "--simulate_dyn_prompt", "0")
    assert "--simulate_dyn_prompt" in one_error(rc, err)


# -- --help, warnings and what stays refused -----------------------------------------------------------------------


def test_help_lists_the_implemented_flags(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--dataset_name", "--column_name", "--dataset_max_samples", "--run_partial_dataset", "--peft_model",
                 "--bad_words", "--simulate_dyn_prompt", "--regional_compile", "--force_static_compile",
                 "--bucket_internal", "--reduce_recompile"):  # fmt: skip
        assert flag in out, flag
    for flag in ("--force_words", "--load_quantized_model_with_inc", "--mlcommons_dataset"):
        assert flag not in out, flag  # refused: parsed, not offered


def test_compile_companions_without_torch_compile_warn(capsys, folder):
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, "--regional_compile")
    assert rc == 0, err
    assert "--regional_compile without --torch_compile: changes nothing" in err


@pytest.mark.parametrize(
    "flag, needle",
    [
        (("--load_quantized_model_with_inc",), "builds a transformers model"),
        (("--save_quantized_model_with_inc",), "fused qkv/gate_up"),
        (("--local_quantized_inc_model_path", "x"), "format='default'"),
    ],
    ids=["load-inc", "save-inc", "local-inc"],
)
def test_inc_checkpoints_stay_refused_with_the_reason(capsys, folder, flag, needle):
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, *flag)
    assert needle in one_error(rc, err)
