"""Saving and loading without lost work or silent wrong weights (issue 14): Trainer checkpoints of polyfuse models
are transformers checkpoints, save_pretrained replaces an older checkpoint atomically, a tied config with its own
lm_head unties as transformers does, ``polyfuse.patch`` stays callable, run_clm.py's bad input is one line, and a
temperature too small for fp32 samples greedily."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import (  # noqa: F401
    assert_one_clm_error,
    hf_from_pretrained,
    hf_random,
    load_run_clm,
    one_thread,
    run_clm_main,
    tiny_config,
    tiny_llama,
    write_tiny_cli_model,
)
from safetensors import safe_open

from polyfuse.compat import TRANSFORMERS_5
from polyfuse.loader.save import save_pretrained
from polyfuse.models import AutoModelForCausalLM as PfAuto
from polyfuse.models.llama import LlamaForCausalLM as PfLlama
from polyfuse.training import PolyfuseTrainer, PolyfuseTrainingArguments


ROOT = Path(__file__).resolve().parents[1]
IDS = torch.tensor([[1, 17, 42, 99, 5, 230, 64, 12, 200, 33]])


def _keys(folder: Path) -> set:
    keys = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    return keys


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model.eval()(IDS).logits


def _args(tmp, **kw):
    base = {
        "output_dir": str(tmp), "per_device_train_batch_size": 2, "learning_rate": 1e-2, "max_steps": 2,
        "save_steps": 2, "logging_steps": 1, "report_to": [], "use_cpu": True, "seed": 0, "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }  # fmt: skip
    base.update(kw)
    return PolyfuseTrainingArguments(**base)


def _dataset(n=8, length=12):
    ids = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


# -- 1. Trainer checkpoints of polyfuse models --------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_trainer_checkpoint_of_polyfuse_model_is_a_transformers_checkpoint(tmp_path, tied):
    cfg = tiny_llama().config
    cfg.tie_word_embeddings = tied
    model = PfLlama.from_config(cfg, seed=1, training=True)
    before = _logits(PfLlama.from_config(cfg, seed=1))
    trainer = PolyfuseTrainer(model, _args(tmp_path), train_dataset=_dataset())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    trained = _logits(trainer.model)
    assert (trained - before).abs().max() > 1e-3, "training changed nothing"
    for folder in (tmp_path / "checkpoint-2", tmp_path / "final"):
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is tied
        assert (folder / "training_args.bin").is_file()
        keys = _keys(folder)
        assert "model.layers.0.self_attn.q_proj.weight" in keys and "model.layers.1.mlp.up_proj.weight" in keys
        assert not any("qkv_proj" in k or "gate_up_proj" in k for k in keys), sorted(keys)
        assert ("lm_head.weight" in keys) is not tied
        theirs = hf_from_pretrained(str(folder))
        ours = PfAuto.from_pretrained(str(folder))
        assert (theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()) is tied
        torch.testing.assert_close(_logits(theirs), trained, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(_logits(ours), trained, atol=1e-6, rtol=1e-6)


# -- 2. save_pretrained over an older checkpoint ------------------------------------------------------------------

OTHER_FILES = {"tokenizer.json": "{}", "optimizer.pt": "x", "notes.txt": "keep me", "pytorch_model.bin": "y"}


def _two_models():
    cfg = tiny_config(tie_word_embeddings=False)
    return PfLlama.from_config(cfg, seed=1), PfLlama.from_config(cfg, seed=2)


@pytest.mark.parametrize("old_sharded", [True, False], ids=["sharded_then_single", "single_then_sharded"])
def test_save_over_an_older_checkpoint_replaces_its_weights(tmp_path, old_sharded):
    old, new = _two_models()
    shard = 40_000  # bytes: the tiny model in about a dozen shards
    save_pretrained(old, str(tmp_path), max_shard_bytes=shard if old_sharded else 4 << 30)
    for name, text in OTHER_FILES.items():
        (tmp_path / name).write_text(text)
    assert (tmp_path / "model.safetensors.index.json").is_file() is old_sharded
    save_pretrained(new, str(tmp_path), max_shard_bytes=4 << 30 if old_sharded else shard)

    weights = sorted(p.name for p in tmp_path.glob("model*"))
    if old_sharded:
        assert weights == ["model.safetensors"]
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and weights == sorted([*shards, "model.safetensors.index.json"])
    for name, text in OTHER_FILES.items():  # only the old checkpoint's weights and index go
        assert (tmp_path / name).read_text() == text
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left
    want = _logits(new)
    assert (want - _logits(old)).abs().max() > 1e-2
    torch.testing.assert_close(_logits(PfAuto.from_pretrained(str(tmp_path))), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(_logits(hf_from_pretrained(str(tmp_path))), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError], ids=["ctrl_c", "disk_full"])
def test_interrupted_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch, exc):
    import safetensors.torch

    old, new = _two_models()
    save_pretrained(old, str(tmp_path), max_shard_bytes=40_000)
    (tmp_path / "notes.txt").write_text("keep me")
    snapshot = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_save, calls = safetensors.torch.save_file, []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:  # half-write the third shard, then fail
            Path(filename).write_bytes(b"\0" * 100)
            raise exc("interrupted mid-save")
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with pytest.raises(exc):
        save_pretrained(new, str(tmp_path), max_shard_bytes=40_000)
    assert len(calls) == 3
    # The same files with the same bytes: nothing half-written, no staging folder, the old checkpoint loads.
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == snapshot
    torch.testing.assert_close(_logits(PfAuto.from_pretrained(str(tmp_path))), _logits(old), atol=1e-6, rtol=1e-6)


def test_save_into_a_file_path_is_refused(tmp_path):
    old, _ = _two_models()
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a folder"):
        save_pretrained(old, str(tmp_path / "f"))
    assert (tmp_path / "f").read_text() == "x"


# -- 3. polyfuse.patch is callable before and after `import polyfuse.patch` ----------------------------------------

PATCH_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers import tiny_llama
import polyfuse
assert "polyfuse.patch" not in sys.modules
model, ids = tiny_llama(seed=3).eval(), torch.arange(3, 40)[None]
with torch.no_grad():
    ref = model(ids).logits
    first = polyfuse.patch(model)                      # first access: through polyfuse.__getattr__
    a = model(ids).logits
    polyfuse.unpatch(model)
    import polyfuse.patch                              # the subpackage, bound as polyfuse.patch
    second = polyfuse.patch(model)
    b = model(ids).logits
print(type(first).__name__, type(second).__name__, float((a - ref).abs().max()), float((b - ref).abs().max()),
      first.patched["rms_norm"], second.patched["rms_norm"])
"""


@pytest.mark.slow
def test_polyfuse_patch_callable_before_and_after_importing_the_subpackage():
    code = PATCH_SCRIPT.format(tests=str(ROOT / "tests"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second, diff_a, diff_b, norms_a, norms_b = r.stdout.split()
    assert first == second == "PatchHandle"
    assert float(diff_a) < 1e-5 and float(diff_b) < 1e-5
    assert norms_a == norms_b == "5"  # 2 layers x 2 norms + the final norm, patched both times


# -- 4. tie_word_embeddings with a different lm_head in the checkpoint ---------------------------------------------


def _tied_config_with_own_head(folder: Path, equal: bool = False) -> transformers.LlamaForCausalLM:
    hf = hf_random(tiny_config(tie_word_embeddings=False, vocab_size=4096), seed=4)
    if equal:
        hf.lm_head.weight.data.copy_(hf.model.embed_tokens.weight.data)
    hf.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(cfg))
    return hf


def test_tied_config_with_a_different_lm_head_unties_like_transformers(tmp_path, caplog):
    from polyfuse.loader import load as loading

    folder = tmp_path / "ckpt"
    hf = _tied_config_with_own_head(folder)
    theirs = hf_from_pretrained(str(folder))
    if TRANSFORMERS_5:  # 5.x unties, as polyfuse does; 4.x (4.55) ties and drops the checkpoint's lm_head
        assert theirs.lm_head.weight.data_ptr() != theirs.model.embed_tokens.weight.data_ptr()  # transformers unties
        assert torch.equal(theirs.lm_head.weight, hf.lm_head.weight)
    want = _logits(theirs if TRANSFORMERS_5 else hf)
    assert loading.LOAD_WORKERS > 1 or os.cpu_count() == 1  # the threaded loader is what raced
    for _ in range(4):  # the old loader's result changed from load to load
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="polyfuse"):
            ours = PfAuto.from_pretrained(str(folder))
        rows_from_embedding = (ours.lm_head.weight == hf.model.embed_tokens.weight).all(-1).float().mean().item()
        assert rows_from_embedding == 0.0
        assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
        assert torch.equal(ours.model.embed_tokens.weight, hf.model.embed_tokens.weight)
        torch.testing.assert_close(_logits(ours), want, atol=2e-5, rtol=1e-5)
        assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
        assert ours.config.tie_word_embeddings is False
        warnings = [r.getMessage() for r in caplog.records if r.name == "polyfuse"]
        assert len(warnings) == 1 and warnings[0].startswith("warning: tie_word_embeddings is true"), warnings
        assert "untying" in warnings[0]
    ours.save_pretrained(str(tmp_path / "copy"))  # the untied head is saved and read back by both
    assert "lm_head.weight" in _keys(tmp_path / "copy")
    torch.testing.assert_close(_logits(hf_from_pretrained(str(tmp_path / "copy"))), want, atol=2e-5, rtol=1e-5)


def test_tied_config_with_an_equal_lm_head_stays_tied(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    hf = _tied_config_with_own_head(folder, equal=True)
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        ours = PfAuto.from_pretrained(str(folder))
    assert not [r for r in caplog.records if r.name == "polyfuse"]
    assert ours.config.tie_word_embeddings is True
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    torch.testing.assert_close(_logits(ours), _logits(hf_from_pretrained(str(folder))), atol=2e-5, rtol=1e-5)


# -- 5. run_clm.py ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_clm():
    module = load_run_clm("run_clm_under_test")
    yield module
    sys.modules.pop("run_clm_under_test", None)


@pytest.fixture(scope="module")
def tiny_clm_folder(tmp_path_factory):
    from test_training import _tiny_model_folder

    return _tiny_model_folder(tmp_path_factory.mktemp("tiny_clm"))


def _clm(run_clm, capsys, *argv):
    return run_clm_main(run_clm, capsys, *argv)


def _one_error(rc, out, err, needle):
    assert_one_clm_error(rc, out, err, needle)


def test_run_clm_quick_start_polyfuse_model_saves_loadable_checkpoints(run_clm, capsys, tiny_clm_folder, tmp_path):
    """docs/training.md's `--model_impl polyfuse` quick start, on a tied model (SmolLM2 is tied): it used to stop
    with 'Some tensors share memory' and an empty checkpoint-2/."""
    out_dir = tmp_path / "out"
    rc, out, err = _clm(
        run_clm, capsys, "--model_name_or_path", tiny_clm_folder, "--model_impl", "polyfuse", "--output_dir", out_dir,
        "--max_steps", "2", "--report_to", "none", "--use_cpu", "--block_size", "32", "--per_device_train_batch_size",
        "2", "--save_steps", "2", "--config_overrides", "tie_word_embeddings=true", "--learning_rate", "1e-2",
    )  # fmt: skip
    assert rc == 0, err[-3000:]
    assert "saved to" in out
    logits = []
    for folder in (out_dir, out_dir / "checkpoint-2"):
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
        assert "lm_head.weight" not in _keys(folder)
        theirs, ours = hf_from_pretrained(str(folder)), PfAuto.from_pretrained(str(folder))
        logits.append(_logits(theirs))
        torch.testing.assert_close(_logits(ours), logits[-1], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)  # the final save is step 2's weights


@pytest.mark.parametrize("impl", ["transformers", "polyfuse"])
def test_run_clm_unknown_rope_type_is_one_line(run_clm, capsys, tiny_clm_folder, tmp_path, impl):
    import shutil

    folder = tmp_path / "bad_rope"
    shutil.copytree(tiny_clm_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    if TRANSFORMERS_5 or impl == "polyfuse":  # polyfuse reads 5.x's field under 4.x too (compat.py)
        cfg["rope_parameters"] = {"rope_type": "bogus", "rope_theta": 10000.0}
    else:  # transformers 4.x reads rope_scaling and ignores rope_parameters
        cfg["rope_scaling"] = {"rope_type": "bogus", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    rc, out, err = _clm(
        run_clm, capsys, "--model_name_or_path", folder, "--model_impl", impl, "--output_dir", tmp_path / "out",
        "--max_steps", "1", "--report_to", "none", "--use_cpu", "--block_size", "32",
    )  # fmt: skip
    _one_error(rc, out, err, "rope type 'bogus' is not supported (known: default, dynamic, linear, llama3")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--max_steps", "0"], "--max_steps must be > 0 (or -1 to train for --num_train_epochs)"),
        (["--num_train_epochs", "0"], "--num_train_epochs must be > 0 when --max_steps is not set"),
    ],
    ids=["max_steps_0", "epochs_0"],
)
def test_run_clm_zero_steps_refused_before_training(run_clm, capsys, tiny_clm_folder, tmp_path, argv, needle):
    out_dir = tmp_path / "out"
    rc, out, err = _clm(
        run_clm, capsys, "--model_name_or_path", tiny_clm_folder, "--output_dir", out_dir, "--report_to", "none",
        "--use_cpu", "--block_size", "32", *argv,
    )  # fmt: skip
    _one_error(rc, out, err, needle)
    assert not out_dir.exists() or not any(out_dir.iterdir())


_INTERRUPT_IMPORT = """
import runpy, sys
class Interrupt:  # Ctrl-C arriving while transformers is being imported
    def find_spec(self, name, path=None, target=None):
        if name == "transformers":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
sys.argv = ["run_clm.py", "--output_dir", "unused"]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_run_clm_ctrl_c_during_imports_exits_130_without_traceback():
    code = _INTERRUPT_IMPORT.format(script=str(ROOT / "examples" / "run_clm.py"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and r.stderr.strip() == "run_clm.py: interrupted", r.stderr


# -- 6. a temperature too small for fp32 -------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 1e-300])
def test_tiny_temperature_samples_the_argmax(temperature):
    from transformers.generation.logits_process import TemperatureLogitsWarper

    from polyfuse.generation.sampling import next_token, warp

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen) * 8
    logits[3] = -logits[3].abs() - 1  # every score negative: all overflow to -inf when divided
    # transformers' own warper turns these rows into nan (its multinomial then raises): no reference to match.
    assert torch.isnan(TemperatureLogitsWarper(temperature)(None, logits.clone()).softmax(-1)).all()
    scores = warp(logits, temperature, top_k=50, top_p=0.9)
    probs = scores.softmax(-1)
    assert torch.isfinite(probs).all()
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 300).float())
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        assert torch.equal(next_token(logits, True, temperature, None, None, g), logits.argmax(-1))


def test_tiny_temperature_ties_share_the_draw_and_finite_rows_are_untouched():
    from transformers.generation.logits_process import TemperatureLogitsWarper

    from polyfuse.generation.sampling import next_token, warp

    # Row 0 overflows at 1e-40; row 1 (scores of 1e-5) stays finite and must be exactly transformers' values.
    logits = torch.tensor([[1.0, 5.0, 5.0, -2.0, 5.0], [1e-5, 2e-5, 3e-5, 4e-5, 5e-5]])
    scores = warp(logits, 1e-40)
    assert scores[0].tolist() == [float("-inf"), 0.0, 0.0, float("-inf"), 0.0]
    reference = TemperatureLogitsWarper(1e-40)(None, logits.clone())[1]
    assert torch.isfinite(reference).all() and torch.equal(scores[1], reference)
    g = torch.Generator().manual_seed(0)
    drawn = {int(next_token(logits, True, 1e-40, generator=g)[0]) for _ in range(200)}
    assert drawn == {1, 2, 4}  # the three tied top tokens, and only them
    for t in (0.7, 1e-3, 1e-36):  # no overflow at these: transformers' values, bit for bit
        assert torch.equal(warp(logits * 8, t), TemperatureLogitsWarper(t)(None, logits * 8))


@pytest.fixture(scope="module")
def cli_folder(tmp_path_factory):
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models.builtin import builtin_model

    try:
        tokenizer = load_tokenizer(*builtin_model())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return write_tiny_cli_model(str(tmp_path_factory.mktemp("tiny_cli")), tokenizer, max_position_embeddings=64)


def test_run_generation_tiny_temperature_is_greedy(capsys, cli_folder, tmp_path):
    from polyfuse.cli.generate import main

    outputs = {}
    for name, extra in (("greedy", []), ("sample", ["--do_sample", "--temperature", "1e-40"])):
        rc = main([
            "--model_name_or_path", cli_folder, "--device", "cpu", "--warmup", "0", "--n_iterations", "1",
            "--max_new_tokens", "8", "--batch_size", "2", "--prompt", "Hello there", "The capital of France is",
            "--output_dir", str(tmp_path / name), *extra,
        ])  # fmt: skip
        out, err = capsys.readouterr()
        assert rc == 0 and "Traceback" not in out + err, err[-3000:]
        outputs[name] = json.loads((tmp_path / name / "results.json").read_text())["output"]
    assert len(outputs["greedy"]) == 2 and outputs["sample"] == outputs["greedy"]
