"""The GPU benchmark scripts run end to end on the CPU at a tiny shape and write what the docs tables are built from."""

import json
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)


def _run(args, timeout=240):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return proc


def test_benchmark_generation_tiny(tmp_path):
    out = tmp_path / "gen.jsonl"
    _run([
        "examples/benchmark_generation.py", "--shapes", "tiny", "--batch_sizes", "1,2", "--new_tokens", "4",
        "--prompt_len", "8", "--peers", "eager", "--peer_shapes", "tiny", "--peer_batch_sizes", "1",
        "--prefill", "16", "--flags", "", "--output", str(out),
    ])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    decode = [(r["impl"], r["bs"]) for r in rows if r["what"] == "decode"]
    assert decode == [("polyfuse", 1), ("transformers", 1), ("polyfuse", 2)]
    assert all(r["tok_per_s"] > 0 for r in rows if r["what"] == "decode")
    prefill = {(r["impl"], r["attention"]) for r in rows if r["what"] == "prefill"}
    assert {("polyfuse", "native"), ("transformers", "sdpa")} <= prefill


def test_benchmark_training_tiny(tmp_path):
    out = tmp_path / "train.json"
    _run(["examples/benchmark_training.py", "--shape", "tiny", "--seq", "32", "--steps", "1", "--output", str(out)])
    cases = json.loads(out.read_text())["cases"]
    got = {(c["variant"], c["seq"]) for c in cases if "tokens_per_s" in c}
    assert got == {("transformers", 32), ("polyfuse", 32)}
    assert all(c["tokens_per_s"] > 0 and c["loss"] > 0 for c in cases if "tokens_per_s" in c)
