"""run_generation.py / polyfuse.cli.generate: one end-to-end run of the built-in model in a subprocess (Paris), then
in-process ``main([...])`` calls on a tiny random Llama (with a real tokenizer) for warnings, and on broken inputs,
each of which must exit non-zero with exactly one "error:" line and no traceback."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import one_thread, write_tiny_cli_model  # noqa: F401  (one_thread: autouse fixture)

from polyfuse.cli.generate import main


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    from polyfuse.engine.tokenizer import load_tokenizer
    from polyfuse.models.builtin import builtin_model

    try:
        return load_tokenizer(*builtin_model())
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer):
    """A random 2-layer Llama with 32 positions, saved with the built-in tokenizer."""
    return write_tiny_cli_model(str(tmp_path_factory.mktemp("tiny_llama")), tokenizer, max_position_embeddings=32)


def _write_gguf(path: Path, arch: str, **metadata) -> Path:
    """A one-block GGUF with a [4, 8] embedding and the given metadata (``add_<key>(value)`` of GGUFWriter)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for key, value in metadata.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def run_main(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error(rc, out, err, *needles):
    assert rc != 0, (out, err)
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


FAST = ("--device", "cpu", "--warmup", "0", "--n_iterations", "1", "--max_new_tokens", "4")


# -- end to end: the built-in model --------------------------------------------------------------------------------


def test_builtin_paris_end_to_end(tmp_path, tokenizer):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_generation.py"),
        "--prompt",
        "What is the capital of France?",
        "--use_chat_template",
        "--max_new_tokens",
        "20",
        "--warmup",
        "1",
        "--n_iterations",
        "1",
        "--output_dir",
        str(tmp_path),
        "--print_backends",
    ]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    out, err = p.stdout, p.stderr
    assert p.returncode == 0, err[-3000:]
    assert "Traceback" not in out + err
    assert "Paris" in out
    # The backend report (--print_backends): one line per op.
    assert re.search(r"^polyfuse backends \(device=cpu, platform=cpu, dtype=float32\):$", out, re.M)
    for op in ("rms_norm", "add_rms_norm", "attention", "rotary", "swiglu", "linear_cross_entropy"):
        assert re.search(rf"^  {op}\s+native:native\s+\S", out, re.M), op
    assert "--use_flash_attention not set" in out
    # The Stats block, optimum-habana style.
    assert "Stats:" in out
    num = r"[0-9.e+-]+"
    assert re.search(rf"^Throughput \(including tokenization\) = {num} tokens/second$", out, re.M)
    assert re.search(rf"^Average first token latency\s+= {num} ms$", out, re.M)
    assert re.search(rf"^Average rest token latency\s+= {num} ms$", out, re.M)
    assert re.search(rf"^Max memory allocated\s+= {num} GB$", out, re.M)
    assert re.search(rf"^Graph compilation duration\s+= {num} seconds$", out, re.M)
    results = json.loads((tmp_path / "results.json").read_text())
    for key in ("throughput", "avg_first_token_latency", "avg_rest_token_latency", "avg_e2e_latency"):
        assert isinstance(results[key], float) and results[key] > 0, key
    assert results["input"] and "What is the capital of France?" in results["input"][0]
    assert len(results["output"]) == 1 and "Paris" in results["output"][0]


# -- runs on the tiny model ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, fallback",
    [
        ("--use_hpu_graphs", "--use_hpu_graphs needs device hpu, this run is on cpu: no HPU graphs"),
        ("--use_cuda_graphs", "--use_cuda_graphs needs device cuda, this run is on cpu: eager steps, no CUDA graphs"),
    ],
    ids=["hpu_graphs", "cuda_graphs"],
)
def test_device_flags_warn_once_and_run(capsys, tiny_folder, tmp_path, flag, fallback):
    rc, out, err = run_main(
        capsys, "--model_name_or_path", tiny_folder, *FAST, flag, "--use_kv_cache", "--output_dir", tmp_path
    )
    assert rc == 0, err
    assert "Traceback" not in out + err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {fallback}"), err
    assert "Stats:" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["device"] == "cpu" and len(results["output"]) == 1


def test_prompt_longer_than_positions(capsys, tiny_folder):
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny_folder, *FAST, "--prompt", "word " * 60)
    line = assert_one_error(rc, out, err, "exceeds the model's 32 positions", "+ 4 new tokens")
    assert re.search(r"prompt of \d+ tokens", line)


def test_help_lists_optimum_habana_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--model_name_or_path",
        "--max_new_tokens",
        "--max_input_tokens",
        "--batch_size",
        "--bf16",
        "--use_kv_cache",
        "--use_hpu_graphs",
        "--limit_hpu_graphs",
        "--use_flash_attention",
        "--flash_attention_recompute",
        "--flash_attention_causal_mask",
        "--flash_attention_fast_softmax",
        "--attn_softmax_bf16",
        "--torch_compile",
        "--bucket_size",
        "--reuse_cache",
        "--trim_logits",
        "--do_sample",
        "--ignore_eos",
        "--use_chat_template",
        "--warmup",
        "--n_iterations",
        "--prompt",
        "--output_dir",
    ):
        assert flag in out, flag


# -- bad input: one "error:" line, no traceback ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, needle",
    [
        (("--batch_size", "0"), "--batch_size must be >= 1, got 0"),
        (("--max_new_tokens", "0"), "--max_new_tokens must be >= 1, got 0"),
        (("--top_p", "1.5"), "--top_p must be in (0, 1], got 1.5"),
    ],
)
def test_bad_numbers(capsys, argv, needle):
    rc, out, err = run_main(capsys, "--device", "cpu", *argv)
    assert_one_error(rc, out, err, needle)


def test_hpu_device_without_gaudi(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "habana_frameworks", None)  # make sure no test double is importable
    rc, out, err = run_main(capsys, "--device", "hpu", "--max_new_tokens", "4")
    assert_one_error(rc, out, err, "--device hpu", "no Gaudi found")


def test_missing_checkpoint_folder(capsys, tmp_path):
    missing = tmp_path / "nope"
    rc, out, err = run_main(capsys, "--model_name_or_path", missing, *FAST)
    assert_one_error(rc, out, err, str(missing), "no such checkpoint folder")


def test_folder_without_config(capsys, tmp_path):
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path, *FAST)
    assert_one_error(rc, out, err, "no config.json")


def test_corrupt_config(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path, *FAST)
    assert_one_error(rc, out, err, "config.json", "not valid JSON")


def test_non_llama_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path, *FAST)
    assert_one_error(rc, out, err, "gpt2", "not supported", "llama, mistral, qwen2, qwen3")


def test_corrupt_safetensors(capsys, tmp_path, tiny_folder):
    (tmp_path / "config.json").write_text((Path(tiny_folder) / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage" + b"\x00" * 64)
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path, *FAST)
    assert_one_error(rc, out, err, "model.safetensors", "corrupt safetensors")


def test_truncated_safetensors(capsys, tmp_path, tiny_folder):
    (tmp_path / "config.json").write_text((Path(tiny_folder) / "config.json").read_text())
    data = (Path(tiny_folder) / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path, *FAST)
    assert_one_error(rc, out, err, "model.safetensors")


def test_gguf_of_another_architecture(capsys, tmp_path):
    path = _write_gguf(tmp_path / "tiny-gpt2.gguf", "gpt2", context_length=32, embedding_length=8, head_count=2)
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path, "--gguf_file", path.name, *FAST)
    assert_one_error(rc, out, err, "model_type gpt2 is not supported", "llama, mistral, qwen2, qwen3")


def test_missing_gguf_file(capsys, tmp_path):
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path, "--gguf_file", "nope.gguf", *FAST)
    assert_one_error(rc, out, err, "nope.gguf", "no such GGUF file")


def test_not_a_gguf_file(capsys, tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"this is not a gguf file at all" * 4)
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path, "--gguf_file", "junk.gguf", *FAST)
    assert_one_error(rc, out, err, "junk.gguf", "not a readable GGUF file")


def test_config_json_not_an_object(capsys, tmp_path):
    (tmp_path / "config.json").write_text("[]")
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path, *FAST)
    assert_one_error(rc, out, err, "config.json")


def test_invalid_config_values_give_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "big"}))
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path, *FAST)
    line = assert_one_error(rc, out, err, "invalid llama config", "hidden_size")
    assert err.strip() == line, "the error message spans several lines"


def test_llama_gguf_with_missing_metadata(capsys, tmp_path):
    path = _write_gguf(tmp_path / "incomplete-llama.gguf", "llama")
    rc, out, err = run_main(capsys, "--model_name_or_path", tmp_path, "--gguf_file", path.name, *FAST)
    assert_one_error(rc, out, err, path.name)
