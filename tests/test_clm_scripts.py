"""examples/run_clm.py and examples/run_lora_clm.py take optimum-habana 1.21's language-modeling command lines
unchanged: every field of its scripts' argument classes (read with ast into tests/data) exists with its default and is
classified in docs/training.md; every command line of its language-modeling README (tests/data, model and data
swapped for local tiny ones) parses, stops on this machine with the one line that it needs a Gaudi, passes or names
what polyfuse refuses on the Habana test double, and a few run end to end on the CPU; data sets load offline and
evaluation reports eval_loss and perplexity as optimum-habana's scripts do."""

import json
import math
import os
import sys
import typing
from pathlib import Path
from typing import List, Optional  # noqa: F401  (optimum-habana's annotations are evaluated with these names)

import pytest
from helpers import load_run_clm, one_thread, run_clm_main  # noqa: F401  (autouse)

from polyfuse.training.clm_args import SCRIPT_FIELDS


DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parent.parent
FIELDS = json.loads((DATA / "optimum_habana_1.21_language_modeling_args.json").read_text())["scripts"]
README = json.loads((DATA / "optimum_habana_1.21_language_modeling_readme.json").read_text())
LINES = README["lines"]
CORPUS = (ROOT / "examples" / "data" / "tiny_corpus.txt").read_text().splitlines()
# transformers 5's TrainingArguments has its own use_cache (default False), which the scripts take there
OWN_DEFAULTS = {"use_cache"}


@pytest.fixture(scope="module")
def scripts():
    mods = {s: load_run_clm(f"{s[:-3]}_scripts_under_test", s) for s in ("run_clm.py", "run_lora_clm.py")}
    yield mods
    for s in mods:
        sys.modules.pop(f"{s[:-3]}_scripts_under_test", None)


def _parser(module):
    from transformers import HfArgumentParser

    from polyfuse.training import PolyfuseTrainingArguments
    from polyfuse.training.clm_args import CacheArguments
    from polyfuse.training.clm_script import HAS_OVERWRITE, HAS_USE_CACHE, OutputArguments

    classes = {"run_clm.py": ("ModelArguments", "DataTrainingArguments", "LoraArguments"),
               "run_lora_clm.py": ("LoraModelArguments", "DataArguments", "FinetuneArguments")}[module.PROG]  # fmt: skip
    from polyfuse.training import clm_args

    extra = (() if HAS_USE_CACHE else (CacheArguments,)) + (() if HAS_OVERWRITE else (OutputArguments,))
    return HfArgumentParser((*(getattr(clm_args, c) for c in classes), PolyfuseTrainingArguments, *extra))


def _specs():
    return [pytest.param(script, spec, id=f"{script}:{spec['name']}") for script, classes in FIELDS.items()
            for specs in classes.values() for spec in specs]  # fmt: skip


@pytest.mark.parametrize("script, spec", _specs())
def test_every_script_field_with_its_default_and_type(scripts, script, spec):
    parser = _parser(scripts[script])
    ns = parser.parse_args(["--output_dir", "o"])
    name = spec["name"]
    assert hasattr(ns, name), f"{script} has no --{name}"
    if name not in OWN_DEFAULTS:
        want = spec.get("default") if "default_factory" not in spec else eval(spec["default_factory"])()
        assert getattr(ns, name) == want, (name, getattr(ns, name), want)
    owner = next(dc for dc in parser.dataclass_types if name in dc.__dataclass_fields__)
    if name not in OWN_DEFAULTS:  # Optional[str] and str with a None default parse alike (run_clm.py's token)
        got, want = typing.get_type_hints(owner)[name], eval(spec["type"])
        assert got == want or (spec.get("default", 0) is None and got == Optional[want]), (name, got, want)
        assert owner.__dataclass_fields__[name].metadata.get("choices") == spec.get("choices"), name
    assert name in SCRIPT_FIELDS, f"{name} is not classified in clm_args.SCRIPT_FIELDS"


def test_docs_table_names_every_script_field():
    import re

    text = (ROOT / "docs" / "training.md").read_text()
    rows = dict(re.findall(r"^\| `--(\w+)` \|[^|]*\| (implemented|warned|refused) \|", text, re.M))
    for name, (status, _) in SCRIPT_FIELDS.items():
        assert rows.get(name) == status, f"--{name} missing or misclassified in docs/training.md's scripts table"


# -- tiny local data and model -------------------------------------------------------------------------------------


def _jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def needs_datasets():
    """The data is read through the datasets library (the dev extra has it; optimum-habana's pins' venv may not)."""
    pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """{name: path} of the swapped-in data and model (placeholders of the README lines)."""
    from test_training import _tiny_model_folder

    root = tmp_path_factory.mktemp("lm_local")
    texts = [{"text": t} for t in CORPUS if t.strip()]
    wiki = root / "wikitext"  # a local folder with wikitext's configuration name and splits
    for split, rows in (("train", texts * 3), ("validation", texts[:6]), ("test", texts[6:10])):
        _jsonl(wiki / "wikitext-2-raw-v1" / f"{split}.jsonl", rows)
    (wiki / "README.md").write_text(
        "---\nconfigs:\n- config_name: wikitext-2-raw-v1\n  data_files:\n"
        + "".join(f"  - split: {s}\n    path: wikitext-2-raw-v1/{s}.jsonl\n" for s in ("train", "validation", "test"))
        + "---\n"
    )
    alpaca = [{"instruction": f"Repeat the line {i}.", "input": "" if i % 3 else f"line {i}", "output": t["text"]}
              for i, t in enumerate(texts * 2)]  # fmt: skip
    _jsonl(root / "alpaca" / "train.jsonl", alpaca)
    _jsonl(root / "finred" / "train.jsonl", alpaca)
    _jsonl(root / "finred" / "validation.jsonl", alpaca[:6])
    _jsonl(root / "guanaco" / "train.jsonl", texts * 2)
    _jsonl(root / "guanaco" / "test.jsonl", texts[:4])
    _jsonl(root / "files" / "train.json", texts)
    _jsonl(root / "files" / "validation.json", texts[:6])
    return {"wikitext": str(wiki), "alpaca": str(root / "alpaca"), "finred": str(root / "finred"),
            "guanaco": str(root / "guanaco"),
            "train_file": str(root / "files" / "train.json"), "validation_file": str(root / "files" / "validation.json"),
            "tiny_model": str(_tiny_model_folder(root / "tiny")), "cache": str(root / "ds_cache")}  # fmt: skip


def _line_args(line, local, out) -> list:
    """The README line's arguments with the placeholders filled in and --output_dir under this test's folder."""
    args = [a.format(**local) for a in line["args"]]
    i = args.index("--output_dir")
    return args[: i + 1] + [str(out)] + args[i + 2 :]


def _ids():
    return [f"{i}-{line['script'][:-3]}" for i, line in enumerate(LINES)]


@pytest.mark.parametrize("line", LINES, ids=_ids())
def test_readme_line_parses(scripts, local, tmp_path, line):
    """No argument of any line is refused by the parser (argparse alone: no 'unrecognized arguments')."""
    _parser(scripts[line["script"]]).parse_args(_line_args(line, local, tmp_path / "out"))


@pytest.mark.parametrize("line", LINES, ids=_ids())
def test_readme_line_here_stops_in_one_line_naming_the_gaudi(scripts, local, tmp_path, monkeypatch, capsys, line):
    """On this machine (no Gaudi) every line is one error line saying --use_habana needs a Gaudi; nothing written."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_clm_main(scripts[line["script"]], capsys, *_line_args(line, local, tmp_path / "out"))
    errors = [x for x in err.splitlines() if "error" in x.lower()]
    assert rc == 2 and len(errors) == 1 and "--use_habana needs an Intel Gaudi" in errors[0], err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


# What polyfuse refuses of a line on a Gaudi (the double): the first refusal, one line (None: accepted).
# The FSDP line's fsdp_config.json names no fsdp_version: transformers 5 reads FSDP2, 4.x FSDP1 (refused).
_TRANSFORMERS_5 = int(__import__("transformers").__version__.split(".")[0]) >= 5
ON_GAUDI = {
    3: "--deepspeed needs DeepSpeed", 4: "--deepspeed needs DeepSpeed", 10: "--fp8: fp8 training", 11: "--fp8: fp8 "
    "training", 12: None if _TRANSFORMERS_5 else "polyfuse trains with FSDP2 only", 14: "--context_parallel_size 4",
}  # fmt: skip


@pytest.mark.parametrize("line", LINES, ids=_ids())
def test_readme_line_on_a_gaudi_is_accepted_or_names_the_refusal(scripts, local, tmp_path, monkeypatch, capsys, line):
    """With Habana's bridge (the test double, in the line's PT_HPU_LAZY_MODE) and Habana/gpt2's gaudi config in the
    Hugging Face cache, the arguments pass validation, or stop with one line naming what polyfuse refuses."""
    import huggingface_hub.constants
    from test_gaudi_arguments import _cache_gaudi_config
    from test_hpu_backend import _forget_habana, _import_double

    from polyfuse.training import arguments

    index = LINES.index(line)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fsdp_config.json").write_text(json.dumps(README["files"]["fsdp_config.json"]))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _cache_gaudi_config(tmp_path / "hub", "Habana/gpt2", {"use_fused_adam": True, "use_fused_clip_norm": True,
                                                         "use_torch_autocast": True})  # fmt: skip
    lazy = line["env"].get("PT_HPU_LAZY_MODE")
    _import_double(monkeypatch, None if lazy is None else lazy == "1")
    import habana_frameworks.torch  # noqa: F401

    monkeypatch.setattr(arguments, "hpu_available", lambda: True)
    environ = dict(os.environ)  # transformers 4.x hands --torch_compile and --fsdp to accelerate in the environment
    try:
        scripts[line["script"]].parse_args(_line_args(line, local, tmp_path / "out"))
        rc = 0
    except SystemExit as e:
        rc = e.code
    finally:
        _forget_habana()
        os.environ.clear()
        os.environ.update(environ)
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if "error" in x.lower()]
    if ON_GAUDI.get(index) is None:
        assert rc == 0 and not errors, err
    else:
        assert rc == 2 and len(errors) == 1 and ON_GAUDI[index] in errors[0], err
    assert all(x.startswith("warning: --") for x in err.splitlines() if "warning" in x.lower()), err


# -- end to end on the CPU ----------------------------------------------------------------------------------------

# A Gaudi-only flag and how many values follow it: dropped for a CPU run of a line (with a value, a flag like
# --use_lazy_mode False takes one; bare, none).
GAUDI_ONLY = {"--use_habana": 0, "--use_lazy_mode": 0, "--gaudi_config_name": 1, "--use_hpu_graphs_for_inference": 0,
              "--use_hpu_graphs_for_training": 0, "--deepspeed": 1}  # fmt: skip
BOOL_VALUES = ("True", "False", "true", "false")


def _cpu_form(args: list, script: str, tiny: bool, local: dict) -> list:
    """The line as a CPU user would run it: the Gaudi-only flags dropped, scaled down (later flags win)."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a in GAUDI_ONLY:
            n = GAUDI_ONLY[a] or (1 if i + 1 < len(args) and args[i + 1] in BOOL_VALUES else 0)
            i += 1 + n
            continue
        out.append(a)
        i += 1
    small = ["--max_steps", "4" if tiny else "2", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
             "--report_to", "none", "--use_cpu", "--cache_dir", local["cache"], "--overwrite_output_dir",
             "--logging_steps", "1", "--max_eval_samples", "4"]  # fmt: skip
    small += ["--block_size", "32"] if script == "run_clm.py" else ["--max_seq_length", "48"]
    if tiny and "--config_name" not in out and "--model_type" not in out:
        small += ["--model_name_or_path", local["tiny_model"]]
    return out + small


def _check_results(folder: Path, line) -> None:
    train = "--do_train" in line["args"] or "--do_eval" not in line["args"]
    if train:
        m = json.loads((folder / "train_results.json").read_text())
        assert m["train_samples_per_second"] > 0 and m["train_steps_per_second"] > 0 and m["train_loss"] > 0
    if "--do_eval" in line["args"]:
        e = json.loads((folder / "eval_results.json").read_text())
        assert e["perplexity"] == pytest.approx(math.exp(e["eval_loss"])) and e["eval_samples"] > 0
        every = json.loads((folder / "all_results.json").read_text())
        assert every["eval_loss"] == e["eval_loss"] and (not train or "train_loss" in every)
    if line["script"] == "run_lora_clm.py" and train:
        assert (folder / "adapter_config.json").is_file()


# (line, model): the tiny local Llama, or the built-in model (the line needs its chat template, or is the README's
# first: the two runs of the real model)
E2E = [(0, "builtin"), (1, "tiny"), (5, "tiny"), (6, "tiny"), (15, "tiny"), (16, "tiny"), (7, "tiny"), (8, "builtin"),
       (9, "tiny"), (13, "tiny")]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("index, model", E2E, ids=[f"{i}-{LINES[i]['script'][:-3]}-{m}" for i, m in E2E])
def test_readme_line_runs_on_the_cpu(scripts, local, needs_datasets, tmp_path, monkeypatch, capsys, index, model):
    """The line without its Gaudi-only flags, a few steps on the CPU: exit 0 and optimum-habana's results files."""
    line = LINES[index]
    monkeypatch.chdir(tmp_path)
    args = _cpu_form(_line_args(line, local, tmp_path / "out"), line["script"], model == "tiny", local)
    rc, out, err = run_clm_main(scripts[line["script"]], capsys, *args)
    assert rc == 0, err[-3000:]
    assert not [x for x in err.splitlines() if x.startswith(f"{line['script']}: error")]
    _check_results(tmp_path / "out", line)


# -- data and evaluation ------------------------------------------------------------------------------------------


def test_eval_loss_and_perplexity_are_the_models_on_the_validation_blocks(
    scripts, local, needs_datasets, tmp_path, capsys
):
    """--do_eval alone: eval_loss is the mean loss of transformers' own (unpatched) model over the validation split
    cut as optimum-habana cuts it (each line tokenized, concatenated, 32-token blocks), perplexity its exp."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rc, out, err = run_clm_main(scripts["run_clm.py"], capsys, "--model_name_or_path", local["tiny_model"],
                                "--dataset_name", local["wikitext"], "--dataset_config_name", "wikitext-2-raw-v1",
                                "--do_eval", "--block_size", "32", "--per_device_eval_batch_size", "2", "--output_dir",
                                tmp_path / "out", "--report_to", "none", "--use_cpu", "--cache_dir", local["cache"])  # fmt: skip
    assert rc == 0, err[-2000:]
    got = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    tok = AutoTokenizer.from_pretrained(local["tiny_model"])
    texts = load_dataset(local["wikitext"], "wikitext-2-raw-v1", split="validation", cache_dir=local["cache"])["text"]
    ids = [t for text in texts for t in tok(text)["input_ids"]]
    blocks = torch.tensor([ids[i : i + 32] for i in range(0, len(ids) // 32 * 32, 32)])
    model = AutoModelForCausalLM.from_pretrained(local["tiny_model"]).eval()
    with torch.no_grad():
        losses = [model(b, labels=b).loss for b in blocks.split(2)]
    assert got["eval_samples"] == len(blocks)
    assert got["eval_loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(got["eval_loss"]))
    assert not (tmp_path / "out" / "train_results.json").exists()  # --do_eval alone does not train


def test_save_to_disk_data_set_and_validation_split_percentage(local, needs_datasets, tmp_path):
    """A save_to_disk folder by --dataset_name; without a validation split train[:10%] is held out."""
    from types import SimpleNamespace

    import datasets

    from polyfuse.training.clm_data import load_raw

    datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(40)]}).save_to_disk(str(tmp_path / "saved"))
    data = SimpleNamespace(dataset_name=str(tmp_path / "saved"), dataset_config_name=None, train_file=None,
                           validation_file=None, validation_split_percentage=10, keep_linebreaks=True)  # fmt: skip
    raw = load_raw(data, local["cache"], split_validation=True)
    assert raw["validation"]["text"] == [f"row {i}" for i in range(4)]
    assert raw["train"]["text"] == [f"row {i}" for i in range(4, 40)]
    files = SimpleNamespace(**{**vars(data), "dataset_name": None, "train_file": local["train_file"]})
    raw = load_raw(files, local["cache"], split_validation=True)
    n = len([t for t in CORPUS if t.strip()])
    assert len(raw["validation"]) + len(raw["train"]) == n and len(raw["validation"]) == round(n * 0.1)


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--dataset_name", "wikitext", "--dataset_config_name", "wikitext-2-raw-v1", "--max_steps", "1"],
            "datasets.load_dataset('wikitext', 'wikitext-2-raw-v1')",
        ),
        (["--train_file", "no_such.txt", "--max_steps", "1"], "--train_file 'no_such.txt' does not exist"),
        (["--model_name_or_path", "gpt2"], "is not a local folder or .gguf file"),
        (["--streaming"], "--streaming needs --max_steps"),
        (["--streaming", "--max_steps", "1", "--block_size", "100000"], "fewer tokens than one --block_size"),
    ],
)
def test_bad_data_is_one_error_line(scripts, local, needs_datasets, tmp_path, capsys, args, needle):
    # an empty datasets cache: offline, datasets also takes a cached data set of the same name (the local folder
    # named wikitext that other tests loaded would be one)
    rc, out, err = run_clm_main(scripts["run_clm.py"], capsys, *args, "--output_dir", tmp_path / "out", "--report_to",
                                "none", "--use_cpu", "--cache_dir", tmp_path / "cache")  # fmt: skip
    errors = [x for x in err.splitlines() if "error" in x.lower()]
    assert rc == 2 and len(errors) == 1 and needle in errors[0], err[-2000:]
    assert "Traceback" not in err


def test_readme_generation_line_parses_and_takes_peft_model():
    """The README's run_generation.py line (a prompt-tuned PEFT model) through polyfuse's run_generation flags: it
    parses and --peft_model is taken (the adapter loads at run time; a prompt-tuning one cannot be merged and stops
    there in one line, cli/peft_adapter.py)."""
    from polyfuse.cli.args import build_parser
    from polyfuse.cli.habana_options import HABANA_FLAGS, apply_habana_options

    (line,) = [x for x in README["other_scripts"] if x["script"] == "run_generation.py"]
    args = build_parser().parse_args(line["args"])
    apply_habana_options(args)
    assert args.peft_model == "prompt_tuning_out" and HABANA_FLAGS["--peft_model"][0] == "implemented"


PEFT_RUNS = [("lora", "polyfuse"), ("ia3", "polyfuse"), ("vera", "polyfuse"), ("adalora", "transformers"),
             ("ia3", "transformers"), ("vera", "transformers"), ("llama-adapter", "transformers"),
             ("ln_tuning", "transformers")]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("peft_type, impl", PEFT_RUNS, ids=[f"{p}-{i}" for p, i in PEFT_RUNS])
def test_run_lora_clm_peft_types(scripts, local, needs_datasets, tmp_path, capsys, peft_type, impl):
    """Each --peft_type trains a few steps on the tiny Llama and saves PEFT's adapter with that type."""
    extra = {"adalora": ["--adalora_tinit", "1", "--adalora_tfinal", "1", "--adalora_delta_t", "1"],
             "llama-adapter": ["--adapter_layers", "2", "--adapter_len", "4"]}.get(peft_type, [])  # fmt: skip
    rc, out, err = run_clm_main(scripts["run_lora_clm.py"], capsys, "--model_name_or_path", local["tiny_model"],
                                "--dataset_name", local["alpaca"], "--output_dir", tmp_path / "out", "--max_steps", "4",
                                "--per_device_train_batch_size", "2", "--max_seq_length", "48", "--report_to", "none",
                                "--use_cpu", "--cache_dir", local["cache"], "--peft_type", peft_type, "--model_impl",
                                impl, "--dataset_concatenation", *extra)  # fmt: skip
    assert rc == 0, err[-3000:]
    saved = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert saved["peft_type"] == {"llama-adapter": "ADAPTION_PROMPT"}.get(peft_type, peft_type.upper())
    assert json.loads((tmp_path / "out" / "train_results.json").read_text())["train_loss"] > 0


def test_peft_types_polyfuses_llama_cannot_take_are_one_line(scripts, tmp_path, capsys):
    rc, out, err = run_clm_main(scripts["run_lora_clm.py"], capsys, "--output_dir", tmp_path / "out",
                                "--peft_type", "adalora", "--model_impl", "polyfuse")  # fmt: skip
    errors = [x for x in err.splitlines() if "error" in x.lower()]
    assert rc == 2 and len(errors) == 1 and "--model_impl transformers" in errors[0], err
