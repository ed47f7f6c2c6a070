"""benchmarks/benchmark_generation.py with no arguments on a CPU (issue 54): it ran the GPU-sized defaults and was
killed for memory at 23 GB. Now the CPU gets its own defaults (one warning), a run that cannot fit is one error line
before anything is built, and a readable table follows the JSON lines."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness.memory_plan import GB, check_memory, estimate, fill_defaults  # noqa: E402


def _args(**kw):
    base = dict(shapes=None, batch_sizes=None, prompt_len=None, new_tokens=None, peers=None, peer_shapes=None,
                peer_batch_sizes=None, prefill=None, quant=None, block70b=False)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's defaults: on a GPU the defaults are the GPU's")
def test_no_arguments_on_the_cpu_runs_a_cpu_sized_benchmark_with_a_table():
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "benchmarks/benchmark_generation.py"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    (warning,) = [line for line in p.stderr.splitlines() if "warning: on the CPU the default run" in line]
    assert "--shapes tiny" in warning
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    decode = [r for r in rows if r["what"] == "decode"]
    assert {(r["impl"], r["bs"]) for r in decode} == {("polyfuse", 1), ("polyfuse", 2), ("transformers", 1)}
    table = p.stdout[p.stdout.index("\nDecode:") :].splitlines()
    assert table[2].split()[:2] == ["impl", "mode"] and set(table[3]) == {"-", " "}
    polyfuse_bs1 = next(line for line in table if line.startswith("polyfuse") and line.split()[2] == "1")
    want = next(r for r in decode if r["impl"] == "polyfuse" and r["bs"] == 1)
    assert float(polyfuse_bs1.split()[3]) == pytest.approx(want["tok_per_s"], rel=0.01)
    assert "Prefill:" in p.stdout


def test_what_cannot_fit_is_refused_before_anything_is_built():
    args = _args(shapes="llama3-8b")
    fill_defaults(args, torch.device("cpu"))
    parts = estimate(args, "llama3-8b", torch.float32)
    assert parts["weights"] / GB == pytest.approx(8.03e9 * 4 / GB, rel=0.02)  # Llama-3-8B's 8.03B parameters
    error = check_memory(args, torch.device("cpu"), torch.float32, available=int(20 * GB))
    assert error.startswith("error: --shapes llama3-8b (batch up to 2, float32) needs about")
    assert "20.0 GB is free" in error and "\n" not in error
    assert check_memory(args, torch.device("cpu"), torch.float32, available=int(100 * GB)) is None
    tiny = _args()
    fill_defaults(tiny, torch.device("cpu"))
    assert (
        tiny.shapes == "tiny" and check_memory(tiny, torch.device("cpu"), torch.float32, available=int(4 * GB)) is None
    )


def test_gpu_defaults_stay_the_gpus():
    args = _args()
    assert fill_defaults(args, torch.device("cuda")) is None
    assert args.shapes == "llama3-8b,llama2-7b,llama2-13b" and args.batch_sizes == "1,16,64" and args.new_tokens == 256
    given = _args(shapes="tiny", new_tokens=4)
    assert fill_defaults(given, torch.device("cpu")) is None  # shapes given: no warning
    assert given.new_tokens == 4 and given.batch_sizes == "1,2"
