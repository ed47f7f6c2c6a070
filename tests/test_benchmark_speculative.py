"""benchmarks/benchmark_speculative.py end to end on the CPU at tiny shapes (every part but prompt lookup on the
built-in model), and its rows as make_table.py shows them."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import make_table


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)


@pytest.mark.slow
def test_benchmark_speculative_tiny(tmp_path):
    out = tmp_path / "spec.jsonl"
    proc = subprocess.run(
        [sys.executable, "benchmarks/benchmark_speculative.py", "--shape", "tiny8", "--draft_shape", "tiny", "--ks",
         "2,4", "--taus", "2,4", "--context", "16", "--new_tokens", "12", "--reps", "1", "--output", str(out),
         "--results", str(tmp_path)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    verify = [(r["k"], r["hidden_states"]) for r in rows if r["what"] == "spec_verify"]
    assert verify == [(2, False), (2, True), (4, False), (4, True)]
    assert all(r["verify_ms"] > 0 and r["cost"] > 0 for r in rows if r["what"] == "spec_verify")
    replay = [r for r in rows if r["what"] == "spec_replay"]
    assert [(r["method"], r["k"]) for r in replay] == [("eagle3", 2), ("eagle3", 4), ("draft", 2), ("draft", 4)]
    for r in replay:  # the forced acceptance held: every step emitted its forced tokens (within the length)
        assert 1.5 <= r["tokens_per_step"] <= r["forced_tau"] and r["speedup"] > 0, r
    results = [json.loads(line) for line in (tmp_path / "speculative.jsonl").read_text().splitlines()]
    assert len(results) == len(rows) and all(r["device"] == "cpu" and r["command"] for r in results)
    page = "\n".join(make_table.speculative_table(results))
    assert "| tiny8 | float32 | eagle3 | 4 |" in page and "| tiny8 | float32 | draft (tiny) | 2 |" in page
