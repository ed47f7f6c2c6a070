"""examples/run_clm.py's output folder as transformers' examples keep it (issue 54): a folder holding an earlier run is
refused unless --overwrite_output_dir (and then no stale checkpoint stays beside the new ones), --resume_from_checkpoint
true resumes from the last checkpoint, Ctrl-C saves the finished steps and exits 130, train_results.json names the
run, a .gguf path is a model path, and a LoRA adapter of the built-in model records a base PEFT can load."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_one_clm_error, load_run_clm, one_thread, run_clm_main  # noqa: F401  (autouse)


ROOT = Path(__file__).resolve().parents[1]
TRAIN = ("--report_to", "none", "--use_cpu", "--block_size", "32", "--per_device_train_batch_size", "2",
         "--learning_rate", "1e-3")  # fmt: skip


@pytest.fixture(scope="module")
def run_clm():
    module = load_run_clm("run_clm_newcomer_under_test")
    yield module
    sys.modules.pop("run_clm_newcomer_under_test", None)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from test_training import _tiny_model_folder

    return _tiny_model_folder(tmp_path_factory.mktemp("clm_tiny"))


def _clm(run_clm, capsys, *argv):
    return run_clm_main(run_clm, capsys, *argv)


def _state(folder) -> dict:
    return json.loads((Path(folder) / "trainer_state.json").read_text())


def test_non_empty_output_dir_is_refused_then_overwritten_cleanly(run_clm, capsys, tiny_model, tmp_path):
    out = tmp_path / "out"
    for step in (50, 200):  # an earlier, longer run's checkpoints
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"an earlier run's weights")
    (out / "notes.txt").write_text("mine")
    before = sorted(os.listdir(out))
    rc, stdout, err = _clm(run_clm, capsys, "--model_name_or_path", tiny_model, "--output_dir", out, *TRAIN,
                           "--max_steps", "3", "--save_steps", "3")  # fmt: skip
    assert_one_clm_error(rc, stdout, err, f"--output_dir {out} is not empty")
    assert "--overwrite_output_dir" in err and "--resume_from_checkpoint true" in err
    assert sorted(os.listdir(out)) == before  # untouched
    rc, stdout, err = _clm(run_clm, capsys, "--model_name_or_path", tiny_model, "--output_dir", out, *TRAIN,
                           "--max_steps", "3", "--save_steps", "3", "--overwrite_output_dir")  # fmt: skip
    assert rc == 0, err[-2000:]
    assert "removed 2 checkpoint folder(s) and 1 file(s) of an earlier run" in err
    checkpoints = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert checkpoints == ["checkpoint-3"]  # no stale checkpoint-50 / checkpoint-200 beside it
    assert (out / "notes.txt").read_text() == "mine"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # the new weights, loadable
    info = json.loads((out / "train_results.json").read_text())
    assert info["model_name_or_path"] == os.path.abspath(tiny_model) and info["device"] == "cpu"
    assert info["versions"]["transformers"] and info["polyfuse_flags"] is not None and "train_loss" in info


def test_resume_from_checkpoint_true_takes_the_last_one(run_clm, capsys, tiny_model, tmp_path):
    out = tmp_path / "out"
    rc, stdout, err = _clm(run_clm, capsys, "--model_name_or_path", tiny_model, "--output_dir", out, *TRAIN,
                           "--max_steps", "2", "--save_steps", "1", "--logging_steps", "1")  # fmt: skip
    assert rc == 0, err[-2000:]
    assert _state(out / "checkpoint-2")["global_step"] == 2
    rc, stdout, err = _clm(run_clm, capsys, "--model_name_or_path", tiny_model, "--output_dir", out, *TRAIN,
                           "--max_steps", "4", "--save_steps", "1", "--logging_steps", "1",
                           "--resume_from_checkpoint", "true")  # fmt: skip
    assert rc == 0, err[-2000:]
    state = _state(out)
    assert state["global_step"] == 4
    logged = [e["step"] for e in state["log_history"] if "loss" in e]
    assert logged == [1, 2, 3, 4]  # steps 1-2 come from checkpoint-2's history: it resumed, not restarted
    empty = tmp_path / "empty"
    rc, stdout, err = _clm(run_clm, capsys, "--model_name_or_path", tiny_model, "--output_dir", empty, *TRAIN,
                           "--resume_from_checkpoint", "true")  # fmt: skip
    assert_one_clm_error(rc, stdout, err, "holds no checkpoint-N folder to resume from")


@pytest.mark.slow
def test_ctrl_c_saves_the_finished_steps_and_exits_130(tiny_model, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "examples" / "run_clm.py"), "--model_name_or_path", str(tiny_model),
           "--output_dir", str(out), *TRAIN, "--max_steps", "100000", "--logging_steps", "1",
           "--save_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline, losses = time.monotonic() + 240, 0
        for line in p.stdout:
            losses += "'loss'" in line
            if losses >= 2:
                break
            assert time.monotonic() < deadline, "no training step logged"
        p.send_signal(signal.SIGINT)
        stdout, err = p.communicate(timeout=180)
    finally:
        p.kill()
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    m = re.search(r"run_clm\.py: interrupted at step (\d+) of 100000: saved (\S+) \(continue with "
                  r"--resume_from_checkpoint true\)", err)  # fmt: skip
    assert m, err[-2000:]
    step, saved = int(m.group(1)), Path(m.group(2))
    assert step >= 2 and saved == out / f"checkpoint-{step}"
    assert _state(saved)["global_step"] == step  # a whole checkpoint, trainer_state.json written last
    assert sorted(os.listdir(out)) == [f"checkpoint-{step}"]  # no final save of an unfinished run


def test_ctrl_c_before_training_leaves_no_folder(run_clm, capsys, tiny_model, tmp_path, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_clm, "build_dataset", interrupted)
    out = tmp_path / "new"
    rc, stdout, err = _clm(run_clm, capsys, "--model_name_or_path", tiny_model, "--output_dir", out, *TRAIN)
    assert rc == 130 and err.strip().endswith("run_clm.py: interrupted: nothing saved"), err
    assert not out.exists()


@pytest.mark.slow
def test_gguf_file_path_and_builtin_adapter_base(run_clm, capsys, tmp_path):
    """--model_name_or_path takes the built-in GGUF's file path, and a LoRA adapter trained on the built-in model
    records the Hub model its GGUF was made from as its base (not a path inside site-packages)."""
    from polyfuse.models.builtin import BUILTIN_HUB_ID, builtin_model

    folder, gguf = builtin_model()
    out = tmp_path / "adapter"
    rc, stdout, err = _clm(run_clm, capsys, "--model_name_or_path", os.path.join(folder, gguf), "--output_dir", out,
                           "--model_impl", "polyfuse", "--lora_rank", "2", "--max_steps", "1", "--report_to", "none",
                           "--use_cpu", "--block_size", "16", "--per_device_train_batch_size", "1",
                           "--save_strategy", "no")  # fmt: skip
    assert rc == 0, err[-2000:]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BUILTIN_HUB_ID  # the built-in, given by its file
    out2 = tmp_path / "builtin"
    rc, stdout, err = _clm(run_clm, capsys, "--output_dir", out2, "--model_impl", "polyfuse", "--lora_rank", "2",
                           "--max_steps", "1", "--report_to", "none", "--use_cpu", "--block_size", "16",
                           "--per_device_train_batch_size", "1", "--save_strategy", "no")  # fmt: skip
    assert rc == 0, err[-2000:]
    config = json.loads((out2 / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BUILTIN_HUB_ID
    assert "site-packages" not in (out2 / "adapter_config.json").read_text()


@pytest.mark.slow
def test_builtin_adapter_loads_with_auto_peft_model(run_clm, capsys, tmp_path):
    """The adapter's recorded base loads through PEFT's AutoPeftModelForCausalLM: here from a Hugging Face cache
    holding the built-in weights under HuggingFaceTB/SmolLM2-135M-Instruct (offline), as the Hub serves them."""
    import torch
    from safetensors.torch import load_file

    from polyfuse.models import AutoModelForCausalLM as PolyfuseAuto
    from polyfuse.models.builtin import BUILTIN_HUB_ID, builtin_model

    out = tmp_path / "adapter"
    rc, stdout, err = _clm(run_clm, capsys, "--output_dir", out, "--model_impl", "polyfuse", "--lora_rank", "2",
                           "--max_steps", "1", "--report_to", "none", "--use_cpu", "--block_size", "16",
                           "--per_device_train_batch_size", "1", "--save_strategy", "no")  # fmt: skip
    assert rc == 0, err[-2000:]
    folder, gguf = builtin_model()
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / ("models--" + BUILTIN_HUB_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / sha
    PolyfuseAuto.from_pretrained(folder, gguf_file=gguf, dtype=torch.bfloat16).save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    code = (
        "import sys, torch; from peft import AutoPeftModelForCausalLM; "
        "m = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]); "
        "print(m.peft_config['default'].base_model_name_or_path); "
        "torch.save({k: v for k, v in m.state_dict().items() if 'lora_' in k}, sys.argv[2])"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code, str(out), str(tmp_path / "lora.pt")], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == BUILTIN_HUB_ID
    loaded = torch.load(tmp_path / "lora.pt")
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert len(loaded) == len(saved) > 0
    for name, t in saved.items():
        match = [v for k, v in loaded.items() if k.replace(".default", "").endswith(name.split("base_model.", 1)[-1])]
        assert len(match) == 1 and torch.equal(match[0].float(), t.float()), name
