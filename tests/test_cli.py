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
from helpers import builtin_tokenizer, one_thread, write_tiny_cli_model  # noqa: F401  (one_thread: autouse fixture)

from polyfuse.cli.generate import main


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer()


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
    # Nothing compiles without --torch_compile or device graphs: the warm-up time is no compile time.
    assert re.search(r"^Graph compilation duration\s+= n/a \(nothing to compile: no --torch_compile", out, re.M)
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
        (
            "--cuda_graph_prefill",
            "--cuda_graph_prefill needs device cuda, this run is on cpu: ignored (on Gaudi --use_hpu_graphs graphs the "
            "prompt step unless --limit_hpu_graphs)",
        ),
    ],
    ids=["hpu_graphs", "cuda_graphs", "cuda_graph_prefill"],
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


# -- issue 14: prompts, output files, defaults, checkpoints, chat input ------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder_512(tmp_path_factory, tokenizer):
    """The tiny random Llama with 512 positions: room for chat templates and long decodes."""
    return write_tiny_cli_model(str(tmp_path_factory.mktemp("tiny_llama_512")), tokenizer, max_position_embeddings=512)


def warnings_of(err):
    return [line for line in err.splitlines() if line.startswith("warning:")]


def results_of(folder, name="results.json"):
    return json.loads((Path(folder) / name).read_text(encoding="utf-8"))


LONG_PROMPT = (
    "Paris, Rome and Berlin are large European cities with long histories. Which one is the capital of Italy?"
)


def test_max_input_tokens_truncates_from_the_left(capsys, tiny_folder, tokenizer, tmp_path):
    ids = tokenizer(LONG_PROMPT).input_ids
    kept = tokenizer.decode(ids[-8:])
    assert len(ids) > 8 and kept.endswith("capital of Italy?")
    rc, out, err = run_main(
        capsys, "--model_name_or_path", tiny_folder, *FAST, "--prompt", LONG_PROMPT, "--max_input_tokens", "8",
        "--output_dir", tmp_path,
    )  # fmt: skip
    assert rc == 0, err
    (warning,) = warnings_of(err)
    assert "--max_input_tokens 8" in warning and f"dropped the first {len(ids) - 8} tokens of prompt 1" in warning
    assert f"input 1: {(kept,)}" in out  # the prompt actually used, not the full one
    results = results_of(tmp_path)
    assert results["input"] == [kept]
    # The model saw the question (the end of the prompt): decoded prompt + new tokens start with it.
    assert results["output"][0].startswith(kept)


def test_output_dir_that_is_a_file_fails_before_loading(capsys, tiny_folder, tmp_path, monkeypatch):
    from polyfuse.models import AutoModelForCausalLM

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before --output_dir was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    target = tmp_path / "results_here"
    target.write_text("not a folder")
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny_folder, *FAST, "--output_dir", target)
    assert_one_error(rc, out, err, f"--output_dir {target}", "not a folder")
    assert target.read_text() == "not a folder"


def test_read_only_output_dir_fails_before_loading(capsys, tiny_folder, tmp_path, monkeypatch):
    from polyfuse.models import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("model loaded"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes through the mode bits: make open() in that folder fail as it does for users
        import builtins

        real_open = builtins.open

        def deny(file, *a, **k):
            if str(file).startswith(str(ro) + os.sep):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *a, **k)

        monkeypatch.setattr(builtins, "open", deny)
    try:
        rc, out, err = run_main(capsys, "--model_name_or_path", tiny_folder, *FAST, "--output_dir", ro)
    finally:
        ro.chmod(0o755)
    assert_one_error(rc, out, err, f"--output_dir {ro}", "cannot write there", "Permission denied")
    assert os.listdir(ro) == []


def test_results_json_utf8_with_arguments(capsys, tiny_folder, tmp_path):
    prompt = "Quelle est la capitale de la France ? Réponds — merci"
    out_dir = tmp_path / "new" / "folder"  # created
    rc, out, err = run_main(
        capsys, "--model_name_or_path", tiny_folder, *FAST, "--prompt", prompt, "--output_dir", out_dir,
        "--token", "hf_secret_value",
    )  # fmt: skip
    assert rc == 0, err
    assert warnings_of(err) == ["warning: --token ignored: no Hugging Face Hub id to download"]
    raw = (out_dir / "results.json").read_text(encoding="utf-8")
    assert "Réponds — merci" in raw and "\\u00e9" not in raw  # UTF-8, unescaped
    assert "hf_secret_value" not in raw
    results = json.loads(raw)
    args = results["args"]
    assert (
        args["prompt"] == [prompt] and args["max_new_tokens"] == 4 and args["model_name_or_path"] == str(tiny_folder)
    )
    assert args["bucket_size"] == 128 and args["token"] == "<hidden>"
    assert sorted(os.listdir(out_dir)) == ["results.json"]  # no temporary file left


def test_results_json_interrupted_write_keeps_the_old_file(capsys, tiny_folder, tmp_path, monkeypatch):
    (tmp_path / "results.json").write_text('{"old": true}')

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny_folder, *FAST, "--output_dir", tmp_path)
    assert rc == 130
    assert json.loads((tmp_path / "results.json").read_text()) == {"old": True}
    assert sorted(os.listdir(tmp_path)) == ["results.json"]


def test_empty_prompt_alone_is_an_error(capsys, tiny_folder):
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny_folder, *FAST, "--prompt", "")
    assert_one_error(rc, out, err, "--prompt is empty", "nothing to generate from")


def test_empty_prompt_in_a_batch_starts_from_bos(capsys, tiny_folder, tokenizer, tmp_path):
    import torch

    from polyfuse.models import AutoModelForCausalLM

    rc, out, err = run_main(
        capsys, "--model_name_or_path", tiny_folder, *FAST, "--prompt", "", "Hello there", "--batch_size", "2",
        "--output_dir", tmp_path,
    )  # fmt: skip
    assert rc == 0, err
    (warning,) = warnings_of(err)
    assert "--prompt 1 is empty (input 1 of 2)" in warning and repr(tokenizer.bos_token) in warning
    results = results_of(tmp_path)
    assert results["input"] == [tokenizer.bos_token, "Hello there"]
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    alone = model.generate(torch.tensor([[tokenizer.bos_token_id]]), max_new_tokens=4, bucket_size=128)
    assert results["output"][0] == tokenizer.decode(alone[0], skip_special_tokens=True)
    assert set(results["output"][0]) != {"-"}


def test_default_bucket_size():
    from polyfuse.cli.generate import default_bucket_size

    assert default_bucket_size("cpu", 100) == 128
    assert default_bucket_size("cuda", 4096) == 128
    assert default_bucket_size("cuda", 8000) == 256  # at most 32 buckets (CUDA graph captures)
    assert default_bucket_size("hpu", 8000) == -1  # optimum-habana's default on Gaudi


def _decode_kv_lengths(capsys, monkeypatch, folder, *argv):
    from polyfuse.models.decoder import DecoderForCausalLM

    seen = []
    real = DecoderForCausalLM.step

    def spy(self, input_ids, position_ids, cache_position, key_mask, kv_len):
        seen.append((input_ids.shape[1], kv_len))
        return real(self, input_ids, position_ids, cache_position, key_mask, kv_len)

    monkeypatch.setattr(DecoderForCausalLM, "step", spy)
    rc, out, err = run_main(
        capsys, "--model_name_or_path", folder, "--device", "cpu", "--warmup", "0", "--n_iterations", "1",
        "--use_kv_cache", "--ignore_eos", "--max_new_tokens", "200", "--prompt", "Hello there", *argv,
    )  # fmt: skip
    monkeypatch.undo()
    assert rc == 0, err
    return [kv for n, kv in seen if n == 1]


def test_default_bucketing_attends_only_the_filled_cache(capsys, monkeypatch, tiny_folder_512):
    decode = _decode_kv_lengths(capsys, monkeypatch, tiny_folder_512)
    assert len(decode) == 199 and sorted(set(decode)) == [128, 256]
    assert decode[0] == 128  # the first steps attend 128 keys, not prompt + 200
    # -1 keeps optimum-habana's meaning: no bucketing, every step attends prompt + max_new_tokens.
    decode = _decode_kv_lengths(capsys, monkeypatch, tiny_folder_512, "--bucket_size", "-1")
    assert set(decode) == {202}


@pytest.mark.slow
def test_gguf_folder_without_gguf_file(capsys, tmp_path):
    from polyfuse.models.builtin import builtin_model

    folder, gguf = builtin_model()
    rc, out, err = run_main(capsys, "--model_name_or_path", folder, *FAST, "--output_dir", tmp_path)
    assert rc == 0, err
    assert results_of(tmp_path)["args"]["model_name_or_path"] == folder
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        _write_gguf(two / name, "llama")
    rc, out, err = run_main(capsys, "--model_name_or_path", two, *FAST)
    assert_one_error(rc, out, err, "holds 2 GGUF files (a.gguf, b.gguf)", "--gguf_file")


def test_help_tells_the_truth_about_gguf_and_hub(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "exactly one .gguf" in out and "Hugging Face Hub id" in out


def test_checkpoint_without_tokenizer(capsys, tiny_folder, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(tiny_folder):
        if name == "config.json" or name.endswith(".safetensors") or name == "generation_config.json":
            shutil.copy(Path(tiny_folder) / name, bare / name)
    rc, out, err = run_main(capsys, "--model_name_or_path", bare, *FAST)
    assert_one_error(rc, out, err, f"{bare} has no tokenizer", "--tokenizer", "save_pretrained")
    assert "sentencepiece" not in err
    rc, out, err = run_main(capsys, "--model_name_or_path", bare, "--tokenizer", tiny_folder, *FAST)
    assert rc == 0, err


def test_hub_id_offline_not_cached(capsys, monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    rc, out, err = run_main(capsys, "--model_name_or_path", "polyfuse-test/not-cached", *FAST)
    assert_one_error(rc, out, err, "polyfuse-test/not-cached", "not in the local cache", "hf download")


def test_hub_id_from_the_cache(capsys, monkeypatch, tmp_path, tiny_folder):
    import shutil

    import huggingface_hub.constants

    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--polyfuse-test--tiny"
    shutil.copytree(tiny_folder, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    rc, out, err = run_main(capsys, "--model_name_or_path", "polyfuse-test/tiny", *FAST, "--output_dir", tmp_path)
    assert rc == 0, err
    assert "Stats:" in out and results_of(tmp_path)["device"] == "cpu"


def test_system_prompt(capsys, tiny_folder_512, tmp_path):
    rc, out, err = run_main(
        capsys, "--model_name_or_path", tiny_folder_512, *FAST, "--prompt", "Hi", "--system_prompt",
        "You answer in French.", "--output_dir", tmp_path,
    )  # fmt: skip
    assert rc == 0, err
    (inp,) = results_of(tmp_path)["input"]
    assert (
        inp
        == "<|im_start|>system\nYou answer in French.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_file_multi_turn(capsys, tiny_folder_512, tmp_path):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    chat = tmp_path / "messages.json"
    chat.write_text(json.dumps(messages), encoding="utf-8")
    rc, out, err = run_main(
        capsys, "--model_name_or_path", tiny_folder_512, *FAST, "--chat_file", chat, "--output_dir", tmp_path
    )
    assert rc == 0, err
    (inp,) = results_of(tmp_path)["input"]
    turns = [inp.index(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>") for m in messages]
    assert turns == sorted(turns) and inp.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "content, needle",
    [
        ("[{'role': 'user'}]", "not valid UTF-8 JSON"),
        ('{"role": "user", "content": "hi"}', "expected [{"),
        ('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]', "ends with an assistant"),
        ('[{"role": "user", "content": 3}]', "not {role: str, content: str}"),
    ],
    ids=["not_json", "not_a_list", "ends_with_assistant", "content_not_text"],
)
def test_bad_chat_file(capsys, tmp_path, content, needle):
    chat = tmp_path / "messages.json"
    chat.write_text(content)
    rc, out, err = run_main(capsys, "--device", "cpu", "--chat_file", chat)
    assert_one_error(rc, out, err, f"--chat_file {chat}", needle)


def test_print_new_text_only(capsys, tiny_folder, tmp_path):
    base = ("--model_name_or_path", tiny_folder, *FAST, "--prompt", "Hello there", "--output_dir", tmp_path)
    rc, out, err = run_main(capsys, *base)
    assert rc == 0, err
    (full,) = results_of(tmp_path)["output"]
    rc, out, err = run_main(capsys, *base, "--print_new_text_only")
    assert rc == 0, err
    (new,) = results_of(tmp_path, "results-2.json")["output"]  # the second run into the folder
    assert full.startswith("Hello there") and not new.startswith("Hello there")
    assert new.strip() and full.endswith(new)
    assert f"output 1.1: {(new,)}" in out


def test_trust_remote_code_is_accepted_with_a_note(capsys, tiny_folder):
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny_folder, *FAST, "--trust_remote_code")
    assert rc == 0, err
    (warning,) = warnings_of(err)
    assert "--trust_remote_code ignored" in warning


def test_log_level(capsys):
    import logging

    from transformers.utils import logging as hf_logging

    try:
        rc, out, err = run_main(capsys, "--device", "cpu", "--batch_size", "0", "--log_level", "info")
        assert rc == 2
        assert logging.getLogger("polyfuse").getEffectiveLevel() == logging.INFO
        assert hf_logging.get_verbosity() == logging.INFO
    finally:
        run_main(capsys, "--device", "cpu", "--batch_size", "0")
    assert logging.getLogger("polyfuse").getEffectiveLevel() == logging.WARNING


def test_load_progress_bar_on_a_terminal_only(capsys, tiny_folder, monkeypatch):
    """The CLI draws a tqdm bar from the loader's ``progress(nbytes, total)`` hook, for big checkpoints loading to a
    terminal only; a loader without the hook loads without a bar."""
    import polyfuse.cli.generate as cli
    from polyfuse.models import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained
    hooks = []

    def with_hook(path, progress=None, **kwargs):
        model = real(path, **kwargs)
        hooks.append(progress)
        if progress is not None:
            sizes = [p.numel() * p.element_size() for p in model.parameters()]
            for n in sizes:
                progress(n, sum(sizes))
        return model

    monkeypatch.setattr(cli, "_stderr_is_tty", lambda: True)
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny_folder, *FAST)  # loader without the hook
    assert rc == 0 and "Loading weights" not in err
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", staticmethod(with_hook))
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny_folder, *FAST)  # small checkpoint: quiet
    assert rc == 0 and "Loading weights" not in err and hooks == [None]
    monkeypatch.setattr(cli, "PROGRESS_MIN_BYTES", 0)
    rc, out, err = run_main(capsys, "--model_name_or_path", tiny_folder, *FAST)
    assert rc == 0, err
    assert callable(hooks[-1])
    done = re.findall(r"Loading weights: 100%\|[^|]*\| ([0-9.]+[kMG]?)B?/([0-9.]+[kMG]?)B?", err)
    assert done and done[-1][0] == done[-1][1], err[-500:]


def test_num_return_sequences_are_printed_per_input(capsys, tiny_folder, tmp_path):
    rc, out, err = run_main(
        capsys, "--model_name_or_path", tiny_folder, *FAST, "--prompt", "Hi", "Hello there", "--batch_size", "2",
        "--do_sample", "--num_return_sequences", "2", "--print_new_text_only", "--output_dir", tmp_path,
    )  # fmt: skip
    assert rc == 0, err
    results = results_of(tmp_path)
    assert results["input"] == ["Hi", "Hello there"] and len(results["output"]) == 4
    for i, text in enumerate(results["output"]):
        assert f"output {i // 2 + 1}.{i % 2 + 1}: {(text,)}" in out
    assert out.index("input 2:") > out.index("output 1.2:")
