"""polyfuse-generate as a new user meets it (issue 54): every prompt runs, result files are never overwritten and
say what ran, Ctrl-C keeps what finished, a chat model asked without its template says how to ask it, the Stats
say when a figure means nothing, bad numbers in the forward are one error line, progress bars on a terminal only,
and --help / bad flags are short. The tiny random Llama (with the built-in tokenizer) runs in process; the
built-in model where its behaviour is the point."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import builtin_tokenizer, one_thread, write_tiny_cli_model  # noqa: F401  (one_thread: autouse fixture)

from polyfuse.cli.generate import main


ROOT = Path(__file__).resolve().parents[1]
FAST = ("--device", "cpu", "--warmup", "0", "--n_iterations", "1", "--max_new_tokens", "4")


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return write_tiny_cli_model(str(tmp_path_factory.mktemp("tiny")), tokenizer, max_position_embeddings=512)


def run_main(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def lines(err, prefix):
    return [line for line in err.splitlines() if line.startswith(prefix)]


def one_error(rc, out, err, *needles):
    assert rc != 0, (out, err)
    assert "Traceback" not in out + err
    (line,) = lines(err, "error:")
    for needle in needles:
        assert needle in line, line
    return line


def results(folder, name="results.json"):
    return json.loads((Path(folder) / name).read_text(encoding="utf-8"))


# -- every input runs --------------------------------------------------------------------------------------------------


def test_prompts_beyond_batch_size_run_in_batches(capsys, tiny, tmp_path):
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--prompt", "Say A", "Say B", "Say C",
                            "--batch_size", "2", "--output_dir", tmp_path / "all")  # fmt: skip
    assert rc == 0, err
    assert not lines(err, "warning:"), err
    got = results(tmp_path / "all")
    assert got["input"] == ["Say A", "Say B", "Say C"] and len(got["output"]) == 3
    assert "(2 batches)" in out
    # each output is what that prompt gives on its own
    for i, prompt in enumerate(["Say A", "Say B", "Say C"]):
        rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--prompt", prompt,
                                "--output_dir", tmp_path / prompt)  # fmt: skip
        assert rc == 0, err
        assert results(tmp_path / prompt)["output"] == [got["output"][i]], prompt


def test_fewer_prompts_than_batch_size_fill_one_batch(capsys, tiny, tmp_path):
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--prompt", "Say A", "Say B",
                            "--batch_size", "3", "--output_dir", tmp_path)  # fmt: skip
    assert rc == 0, err
    assert results(tmp_path)["input"] == ["Say A", "Say B", "Say A"]  # optimum-habana's cycling, unchanged


def test_chat_file_with_two_conversations_runs_both(capsys, tiny, tmp_path):
    chats = [[{"role": "user", "content": "Name a color."}], [{"role": "user", "content": "Name a fruit."}]]
    chat = tmp_path / "chats.json"
    chat.write_text(json.dumps(chats))
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--chat_file", chat, "--output_dir",
                            tmp_path / "out")  # fmt: skip
    assert rc == 0, err
    got = results(tmp_path / "out")
    assert len(got["input"]) == 2 and len(got["output"]) == 2
    assert "Name a color." in got["input"][0] and "Name a fruit." in got["input"][1]


def test_prompt_file(capsys, tiny, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("Say A\n\nSay B\n", encoding="utf-8")
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--prompt_file", f, "--output_dir",
                            tmp_path / "out")  # fmt: skip
    assert rc == 0, err
    assert results(tmp_path / "out")["input"] == ["Say A", "Say B"]
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--prompt_file", f, "--prompt", "x")
    one_error(rc, out, err, "--prompt and --prompt_file: give one of them")
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--prompt_file", tmp_path / "nope.txt")
    one_error(rc, out, err, "--prompt_file", "no such file")


# -- result files -------------------------------------------------------------------------------------------------------


def test_a_second_run_into_the_folder_keeps_the_first(capsys, tiny, tmp_path):
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--prompt", "first", "--output_dir", tmp_path)
    assert rc == 0, err
    first = (tmp_path / "results.json").read_text()
    assert f"Results written to {tmp_path / 'results.json'}" in out
    rc, out, err = run_main(
        capsys, "--model_name_or_path", tiny, *FAST, "--prompt", "second", "--output_dir", tmp_path
    )
    assert rc == 0, err
    assert (tmp_path / "results.json").read_text() == first
    assert results(tmp_path, "results-2.json")["input"] == ["second"]
    assert sorted(os.listdir(tmp_path)) == ["results-2.json", "results.json"]
    got = json.loads(first)
    assert got["model"]["name"] == str(tiny) and got["model"]["model_type"] == "llama"
    assert got["device"] == "cpu" and got["flags"]["bucket_size"] == 128 and got["interrupted"] is False
    import torch
    import transformers

    assert got["versions"]["torch"] == torch.__version__
    assert got["versions"]["transformers"] == transformers.__version__ and got["versions"]["polyfuse"]


def test_a_failed_run_leaves_no_empty_output_folder(capsys, tmp_path):
    out_dir = tmp_path / "new"
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path / "missing", *FAST, "--output_dir", out_dir)
    one_error(rc, out, err, "no such checkpoint folder")
    assert not out_dir.exists()


# -- Ctrl-C -----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigint_writes_what_finished_and_exits_130(tiny, tmp_path):
    out_dir = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))  # fmt: skip
    cmd = [sys.executable, str(ROOT / "examples" / "run_generation.py"), "--model_name_or_path", tiny, *FAST,
           "--n_iterations", "100000", "--output_dir", str(out_dir)]  # fmt: skip
    # A suite started in the background (`make test-slow &`) inherits an ignored SIGINT, and so would the child:
    # give it the default disposition, as a terminal's Ctrl-C finds it.
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        for line in p.stdout:
            if line.startswith("Iteration 2/"):
                break
            assert time.monotonic() < deadline, "no timed run finished"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in out + err
    (said,) = lines(err, "interrupted:")
    m = re.match(r"interrupted: (\d+) of 100000 timed runs finished; results in (.*)$", said)
    assert m and int(m.group(1)) >= 2 and m.group(2) == str(out_dir / "results.json"), said
    assert sorted(os.listdir(out_dir)) == ["results.json"]  # no temporary, nothing half-written
    got = results(out_dir)
    assert got["interrupted"] is True and got["timed_runs"] == int(m.group(1)) and len(got["output"]) == 1
    assert got["throughput"] > 0


def test_sigint_before_anything_finished_leaves_no_folder(capsys, tiny, tmp_path, monkeypatch):
    from polyfuse.models.decoder import DecoderForCausalLM

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(DecoderForCausalLM, "generate", interrupted)
    out_dir = tmp_path / "new"
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--output_dir", out_dir)
    assert rc == 130
    assert err.strip() == "interrupted before any run finished: nothing written"
    assert not out_dir.exists()


# -- figures that mean nothing, and the chat model asked plainly ------------------------------------------------------


@pytest.mark.slow
def test_builtin_chat_model_without_template_says_how_to_ask(capsys, tmp_path):
    rc, out, err = run_main(capsys, *FAST, "--prompt", "What is the capital of France?", "--use_kv_cache",
                            "--output_dir", tmp_path, "--no-ignore_eos")  # fmt: skip
    assert rc == 0, err
    (warning,) = lines(err, "warning:")
    assert "ended at its first token (EOS)" in warning and "--use_chat_template" in warning
    assert re.search(r"^Average rest token latency\s+= n/a \(every run stopped at its first token", out, re.M)
    assert re.search(r"^Throughput .* tokens/second \(every run stopped at its first token \(EOS\)", out, re.M)
    got = results(tmp_path)
    assert got["avg_rest_token_latency"] is None
    assert got["model"]["name"] == "SmolLM2-135M-Instruct (built-in)"
    assert got["args"]["model_name_or_path"] == got["model"]["path"] and got["args"]["model_name_or_path"]
    rc, out, err = run_main(capsys, *FAST, "--prompt", "What is the capital of France?", "--use_chat_template")
    assert rc == 0 and not lines(err, "warning:"), err  # asked in its template: it answers


@pytest.mark.slow
def test_gguf_file_path_on_the_command_line(capsys, tmp_path):
    from polyfuse.models.builtin import builtin_model

    folder, gguf = builtin_model()
    rc, out, err = run_main(capsys, "--model_name_or_path", os.path.join(folder, gguf), *FAST, "--prompt", "Hi",
                            "--output_dir", tmp_path)  # fmt: skip
    assert rc == 0, err
    assert results(tmp_path)["model"]["gguf_file"] == gguf


def test_compile_time_is_said_only_when_something_compiles():
    from polyfuse.cli.stats import compile_note

    assert "nothing to compile" in compile_note({}, "cpu", 3, 0)
    assert "--warmup 0" in compile_note({"torch_compile": True}, "cpu", 0, 0)
    assert "compiled nothing" in compile_note({"torch_compile": True}, "cuda", 2, 0)
    assert compile_note({"torch_compile": True}, "cpu", 2, 5) is None
    assert compile_note({"use_cuda_graphs": True}, "cuda", 1, 0) is None
    assert compile_note({}, "hpu", 1, 0) is None  # Gaudi's lazy mode compiles every new graph


@pytest.mark.slow
def test_torch_compile_time_is_the_warm_up_that_compiled(capsys, tiny, tmp_path, monkeypatch):
    """--torch_compile (dynamo's eager backend here: no C compiler needed) reported 6e-06 s with --warmup 0; now the
    warm-up's time where it compiled graphs, n/a with the reason where it did not."""
    from polyfuse.core.runtime import DeviceRuntime

    monkeypatch.setattr(DeviceRuntime, "compile_backend", lambda self: "eager")
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--torch_compile", "--use_kv_cache",
                            "--output_dir", tmp_path / "none")  # fmt: skip
    assert rc == 0, err
    assert re.search(r"^Graph compilation duration\s+= n/a \(--warmup 0: any compilation ran inside the timed runs\)$",
                     out, re.M)  # fmt: skip
    assert results(tmp_path / "none")["graph_compilation_duration"] is None
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--torch_compile", "--use_kv_cache",
                            "--warmup", "1", "--output_dir", tmp_path / "one")  # fmt: skip
    assert rc == 0, err
    got = results(tmp_path / "one")
    assert got["graph_compilation_duration"] == got["warmup_duration"] > 0
    assert re.search(r"^Graph compilation duration\s+= [0-9.e+-]+ seconds$", out, re.M)


def test_ops_overrides_are_named(capsys, tiny, tmp_path):
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--ops=-rotary", "--print_backends",
                            "--output_dir", tmp_path)  # fmt: skip
    assert rc == 0, err
    assert re.search(r"^Op overrides\s+= -rotary \(--ops\)$", out, re.M)
    assert "op overrides: -rotary (--ops)" in out
    assert results(tmp_path)["ops"] == "-rotary (--ops)"


# -- bad numbers ---------------------------------------------------------------------------------------------------------


def test_nan_weights_at_the_cli(capsys, tiny, tmp_path):
    from test_newcomer import corrupt_copy

    bad = corrupt_copy(tiny, tmp_path / "bad", "model.layers.0.mlp.gate_proj.weight")
    rc, out, err = run_main(capsys, "--model_name_or_path", bad, *FAST)
    one_error(rc, out, err, "'model.layers.0.mlp.gate_proj.weight'", "NaN or Inf")
    assert "Input/outputs" not in out


def test_overflowing_logits_are_one_error(capsys, tokenizer, tmp_path):
    """Finite weights whose logits overflow float16 (LM head entries of 1e4 over 16 hidden units): one error
    naming the logits and what to try, instead of text decoded from inf; float32 runs."""
    import torch

    from polyfuse.models import AutoModelForCausalLM

    folder = write_tiny_cli_model(str(tmp_path / "loud"), tokenizer, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.full_like(model.lm_head.weight, 1e4))
    model.save_pretrained(folder)
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, "--dtype", "float16")
    one_error(rc, out, err, "the first logits hold NaN or Inf", "float16", "--dtype bfloat16 or float32")
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, "--dtype", "float32", "--use_kv_cache")
    assert rc == 0, err


def test_dtype_flag(capsys, tiny, tmp_path):
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--dtype", "bfloat16", "--output_dir",
                            tmp_path)  # fmt: skip
    assert rc == 0, err
    assert results(tmp_path)["model"]["dtype"] == "bfloat16"
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--bf16", "--dtype", "float16")
    one_error(rc, out, err, "--bf16 and --dtype float16")


def test_small_calibration_text_warns(capsys, tiny, tmp_path):
    short, long = tmp_path / "short.txt", tmp_path / "long.txt"
    short.write_text("The capital of France is Paris.")  # a few tokens: fewer than the 32 inputs of down_proj
    long.write_text("The capital of France is Paris, and the capital of Italy is Rome. " * 8)
    base = ("--model_name_or_path", tiny, *FAST, "--quant", "int8", "--quant_calibration")
    rc, out, err = run_main(capsys, *base, short)
    assert rc == 0, err
    (warning,) = lines(err, "warning:")
    assert f"--quant_calibration {short}:" in warning and "fewer than the 32 inputs" in warning
    rc, out, err = run_main(capsys, *base, long)
    assert rc == 0 and not lines(err, "warning:"), err


# -- progress bars -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_progress_bars_on_a_terminal_only(capsys, tiny, tmp_path, monkeypatch):
    import polyfuse.cli.generate as cli
    import polyfuse.cli.progress as progress

    text = tmp_path / "calib.txt"
    text.write_text("The capital of France is Paris, and the capital of Italy is Rome. " * 8)
    argv = ("--model_name_or_path", tiny, *FAST, "--ignore_eos", "--use_kv_cache", "--quant", "int8",
            "--quant_calibration", text, "--quant_tune_norms", "4")  # fmt: skip
    rc, out, err = run_main(capsys, *argv)  # stderr is no terminal here
    assert rc == 0 and "Generating" not in err and "GPTQ" not in err, err
    monkeypatch.setattr(cli, "_stderr_is_tty", lambda: True)
    monkeypatch.setattr(progress, "GENERATION_BAR_MIN_TOKENS", 4)
    rc, out, err = run_main(capsys, *argv)
    assert rc == 0, err
    assert re.search(r"Generating: +\d+%\|.*\| \d/4", err), err[-800:]
    assert re.search(r"GPTQ int8: 100%\|.*\| 2/2", err), err[-800:]  # the tiny model's two decoder layers
    assert re.search(r"Tuning: .*\| \d/4", err), err[-800:]
    rc, out, err = run_main(capsys, *argv, "--quiet")
    assert rc == 0 and "Generating" not in err and "GPTQ" not in err and "Tuning" not in err, err
    monkeypatch.setattr(cli, "PROGRESS_MIN_BYTES", 0)  # the loading bar: big checkpoints only, and not with --quiet
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST)
    assert rc == 0 and "Loading weights" in err, err
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny, *FAST, "--quiet")
    assert rc == 0 and "Loading weights" not in err, err


# -- --help and bad flags ------------------------------------------------------------------------------------------------


def test_help_is_grouped_with_every_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for group in ("model:", "input:", "generation:", "device and kernels:", "output and timing:"):
        assert re.search(rf"^{re.escape(group)}$", out, re.M), group
    assert re.search(r"^Gaudi compatibility", out, re.M)
    assert len(out.splitlines()) < 160
    from polyfuse.cli.args import build_parser

    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.dest
    entries = {}  # each option's help, its continuation lines joined
    for line in out.splitlines():
        if line.startswith("  -"):
            key = line.split()[0]
            entries[key] = line
        elif line.startswith("   ") and entries:
            entries[key] += " " + line.strip()
    for flag, default in (("--temperature", "1.0"), ("--top_k", "None"), ("--top_p", "1.0"), ("--seed", "27"),
                          ("--max_new_tokens", "100"), ("--warmup", "3"), ("--device", "auto")):  # fmt: skip
        assert " ".join(entries[flag].split()).endswith(f"(default: {default})"), entries[flag]
    takes_value = [k for k, v in entries.items() if k.startswith("--") and re.match(r"\s*--\S+ \S", v)]
    assert len(takes_value) > 30
    for key in takes_value:
        assert "default:" in entries[key], entries[key]
    assert "--dtype {bfloat16,float16,float32}" in out and "--prompt_file FILE" in out


def test_unknown_flag_is_one_line_with_a_suggestion(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--max_new_tokns", "4"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and not out
    assert err.startswith("error: unrecognized argument: --max_new_tokns (did you mean --max_new_tokens?)")


def test_polyfuse_generate_names_itself(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/polyfuse-generate"])
    with pytest.raises(SystemExit):
        main(["--bogus"])
    err = capsys.readouterr().err
    assert "polyfuse-generate --help" in err and "run_generation.py" not in err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: polyfuse-generate ")
    monkeypatch.setattr(sys, "argv", ["examples/run_generation.py"])
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: run_generation.py ")
