"""The GPU benchmark scripts run end to end on the CPU at a tiny shape and write what the docs tables are built from."""

import json
import math
import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)


def _run(args, timeout=240):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return proc


@pytest.mark.slow
def test_benchmark_generation_tiny(tmp_path):
    out = tmp_path / "gen.jsonl"
    _run([
        "benchmarks/benchmark_generation.py", "--shapes", "tiny", "--batch_sizes", "1,2", "--new_tokens", "4",
        "--prompt_len", "8", "--peers", "eager", "--peer_shapes", "tiny", "--peer_batch_sizes", "1",
        "--prefill", "16", "--prefill_idle", "0.01", "--flags", "", "--output", str(out), "--results", str(tmp_path),
    ])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # --results (a folder): the figure rows by kind, each with what make_table.py shows beside its figures
    results = {name: [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
               for name in ("decode.jsonl", "prefill.jsonl")}  # fmt: skip
    assert [(r["impl"], r["bs"]) for r in results["decode.jsonl"]] == [
        ("polyfuse", 1),
        ("transformers", 1),
        ("polyfuse", 2),
    ]
    assert len(results["prefill.jsonl"]) == 5
    for r in results["decode.jsonl"] + results["prefill.jsonl"]:
        assert r["device"] == "cpu" and r["date"] and r["command"].startswith("python ")
        assert {"torch", "transformers", "triton", "cuda"} <= set(r["versions"])
    assert results["decode.jsonl"][0]["prompt_len"] == 8 and results["decode.jsonl"][0]["new_tokens"] == 4
    decode = [(r["impl"], r["bs"]) for r in rows if r["what"] == "decode"]
    assert decode == [("polyfuse", 1), ("transformers", 1), ("polyfuse", 2)]
    assert all(r["tok_per_s"] > 0 for r in rows if r["what"] == "decode")
    prefill = [(r["impl"], r["attention"], r["after_idle_s"]) for r in rows if r["what"] == "prefill"]
    assert prefill == [
        ("polyfuse", "native", 0.0), ("polyfuse", "native", 0.01), ("transformers", "sdpa", 0.0),
        ("transformers", "sdpa", 0.01), ("transformers", "eager", 0.0),
    ]  # fmt: skip
    assert all(r["ms"] > 0 for r in rows if r["what"] == "prefill")


def test_prefill_rows_name_the_attention_that_runs():
    """A prompt step's attention is the first of the chain that takes any input (the one-query decode kernel declines
    it; past the chain, native), with the one-query choice named for the pruned last layer; a chain of one is itself."""
    import importlib.util
    from types import SimpleNamespace as NS

    spec = importlib.util.spec_from_file_location(
        "bench_gen", os.path.join(ROOT, "benchmarks", "benchmark_generation.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    decode, sdpa, native = (
        NS(name="triton_decode", accepts=len),
        NS(name="sdpa_flash", accepts=None),
        NS(name="native", accepts=None),
    )

    def model(chain, prune=True):
        choice = NS(implementation=chain[0], then=list(chain[1:]))
        return NS(kernels=NS(choices={"attention": choice}), prune_last_layer=prune)

    assert bench.prefill_attention(model([decode, sdpa, native])) == "sdpa_flash (last layer: triton_decode)"
    assert bench.prefill_attention(model([decode, sdpa, native], prune=False)) == "sdpa_flash"
    assert bench.prefill_attention(model([sdpa, native])) == "sdpa_flash"
    assert bench.prefill_attention(model([native])) == "native"
    # every choice declines some input (ROCm: no sdpa_flash): a prompt reaches the native reference past the chain
    assert bench.prefill_attention(model([decode])) == "native (last layer: triton_decode)"


@pytest.mark.slow
def test_benchmark_training_tiny(tmp_path):
    out = tmp_path / "train.json"
    proc = _run([
        "benchmarks/benchmark_training.py", "--shape", "tiny", "--seq", "32", "--steps", "1", "--batch", "1,2",
        "--gradient_checkpointing", "--output", str(out),
    ])  # fmt: skip
    res = json.loads(out.read_text())
    assert res["gradient_checkpointing"] is True and res["batches"] == [1, 2] and res["skipped"] == []
    cases = [c for c in res["cases"] if "tokens_per_s" in c]
    got = sorted((c["variant"], c["batch"], c["seq"]) for c in cases)
    assert got == [("polyfuse", 1, 32), ("polyfuse", 2, 32), ("transformers", 1, 32), ("transformers", 2, 32)]
    assert all(math.isfinite(c["tokens_per_s"]) and c["tokens_per_s"] > 0 and c["loss"] > 0 for c in cases)
    assert all(c["gradient_checkpointing"] is True for c in cases)
    ratios = {(r["shape"], r["seq"], r["batch"]): r for r in res["ratios"]}
    assert set(ratios) == {("tiny", 32, 1), ("tiny", 32, 2)}
    for r in ratios.values():
        assert math.isfinite(r["tokens_per_s_ratio"]) and r["tokens_per_s_ratio"] > 0
        assert "peak_mem_ratio" in r  # None on the CPU: no peak-memory counter there
    assert "| batch |" in res["markdown"] and "| grad ckpt |" in res["markdown"]
    assert "ratio tiny seq 32 batch 2: polyfuse/transformers tokens/s" in proc.stdout


def test_benchmark_training_time_budget(tmp_path):
    """A spent budget starts nothing more, says what it skipped, and still writes the JSON."""
    out = tmp_path / "train.json"
    proc = _run([
        "benchmarks/benchmark_training.py", "--shape", "tiny", "--seq", "32", "--steps", "1", "--batch", "1,2",
        "--time_budget_s", "1e-9", "--output", str(out),
    ])  # fmt: skip
    res = json.loads(out.read_text())
    assert res["cases"] == [] and res["ratios"] == []
    assert "tiny/polyfuse batch 2 seq 32" in res["skipped"] and len(res["skipped"]) == 4
    assert "time budget of 1e-09 s spent: skipped tiny/transformers batch 1 seq 32" in proc.stdout


def test_memory_peak_replay_finds_the_blocks_alive_at_the_peak():
    """benchmark_training.py --memory_peak: the replay of the allocator's events keeps the set alive at the highest
    total, not the last or the largest single block."""
    from benchmarks.harness.memory_peak import _site, live_at_peak

    fr = [{"filename": "/x/site-packages/polyfuse/models/decoder.py", "line": 7, "name": "block"}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": fr},
        {"action": "alloc", "addr": 2, "size": 50, "frames": []},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 90, "frames": fr},  # 140 < 150: not the peak
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "alloc", "addr": 4, "size": 20, "frames": fr},
    ]
    peak, live = live_at_peak(trace)
    assert peak == 150 and set(live) == {1, 2}
    assert _site(fr) == "polyfuse/models/decoder.py:7 block"
    assert _site([]) == "(no frames)"


@pytest.mark.slow
def test_benchmark_lora_tiny(tmp_path):
    """benchmarks/benchmark_lora.py: polyfuse + PEFT and transformers + PEFT, the same adapter size, a ratio line."""
    pytest.importorskip("peft")
    out = tmp_path / "lora.json"
    proc = _run([
        "benchmarks/benchmark_lora.py", "--shape", "tiny", "--seq", "32", "--steps", "1", "--batch", "1,2",
        "--gradient_checkpointing", "--output", str(out),
    ])  # fmt: skip
    res = json.loads(out.read_text())
    assert res["shape"] == "tiny" and res["lora"]["rank"] == 16 and len(res["lora"]["target_modules"]) == 7
    cases = [c for c in res["cases"] if "tokens_per_s" in c]
    assert sorted((c["variant"], c["batch"], c["seq"]) for c in cases) == [
        ("polyfuse", 1, 32), ("polyfuse", 2, 32), ("transformers", 1, 32), ("transformers", 2, 32)
    ]  # fmt: skip
    # rank 16 on q/k/v/o/gate/up/down of the tiny shape's 2 layers; the same count on both
    assert {c["trainable_params"] for c in cases} == {32768}
    assert all(math.isfinite(c["tokens_per_s"]) and c["tokens_per_s"] > 0 and c["loss"] > 0 for c in cases)
    assert [(r["seq"], r["batch"]) for r in res["ratios"]] == [(32, 1), (32, 2)]
    assert all(r["tokens_per_s_ratio"] > 0 and r["peak_mem_ratio"] is None for r in res["ratios"])
    assert "ratio tiny LoRA seq 32 batch 2: polyfuse/transformers tokens/s" in proc.stdout


def test_profile_summary_sorts_kernels_by_kind():
    """benchmark_training.py --profile's summary: cuBLAS's Hopper kernels (nvjet_*), CUTLASS / xmma GEMMs, flash and
    Triton attention, and the rest, each kernel's GPU time counted once under its kind."""
    import importlib.util
    from types import SimpleNamespace

    path = os.path.join(ROOT, "benchmarks", "benchmark_training.py")
    spec = importlib.util.spec_from_file_location("benchmark_training_kinds", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    events = [SimpleNamespace(key=k, device_time_total=us) for k, us in (
        ("nvjet_tst_192x192_64x4_1x2_h_bz_coopA_TNT", 5000.0), ("sm90_xmma_gemm_bf16bf16_bf16f32", 2500.0),
        ("cutlass3x_sm90_tensorop_gemm", 500.0), ("flash_fwd_kernel", 1500.0), ("_attn_bwd_dkdv", 250.0),
        ("_rms_norm_fwd_kernel", 750.0), ("void at::native::vectorized_elementwise_kernel", 125.0))]  # fmt: skip
    assert bench.kernel_kinds(events) == {"matmul": 8.0, "attention": 1.75, "other": 0.88}


def test_time_median_pause_idles_before_each_call_outside_the_timing():
    """``pause`` sleeps before every timed call (the device idle) and is not counted in the time."""
    import time

    from benchmarks.harness.measure import time_median

    calls = []
    t0 = time.perf_counter()
    s = time_median(lambda: calls.append(time.perf_counter()), reps=3, warmup=1, pause=0.05)
    assert len(calls) == 4
    assert all(b - a >= 0.05 for a, b in zip(calls, calls[1:]))  # a pause before each timed call, the first too
    assert time.perf_counter() - t0 >= 0.15 and s < 0.01


def test_bench_prefill_times_after_idling_and_frees_the_prompt_graph_before_the_peer(monkeypatch):
    """--prefill_idle: every polyfuse prefill (eager and graphed) and the peer's SDPA one are timed again with the
    pause; the prompt graph is gone before the peer runs (its memory back for the peer's activations)."""
    import gc
    import importlib.util
    import weakref

    import torch

    from benchmarks.harness.shapes import config_for
    from polyfuse.models import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location(
        "bench_gen_idle", os.path.join(ROOT, "benchmarks", "benchmark_generation.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = AutoModelForCausalLM.from_config(config_for("tiny")).eval()
    monkeypatch.setitem(model.flags, "cuda_graph_prefill", True)  # the CPU turns it off at load; the stand-in graphs
    graphs, alive, timed, rows = [], [], [], []

    class Graph:  # stands for the captured prompt step (GraphedStep's call convention)
        def __init__(self, module):
            self.module = module

        def __call__(self, kv_len, *args):
            return self.module(kv_len, *args)

    def graph_module(module, phase, flags):
        graph = Graph(module)
        graphs.append(weakref.ref(graph))
        return graph

    class Peer:
        def set_attn_implementation(self, attn):
            pass

        def __call__(self, ids):
            gc.collect()
            alive.append(graphs[0]() is not None)

    def timed_peak(device, fn, **kw):
        fn()
        timed.append(kw)
        return 0.001, 0

    monkeypatch.setattr(model.runtime, "graph_module", graph_module)
    monkeypatch.setattr(bench, "_timed_peak", timed_peak)
    monkeypatch.setattr(bench, "log", lambda row, out: rows.append(row))
    bench.bench_prefill(model, Peer(), 8, 1, torch.device("cpu"), None, "tiny", idle_s=0.5)
    assert len(graphs) == 1 and alive == [False, False, False]
    assert [(r["impl"], r["after_idle_s"]) for r in rows] == [
        ("polyfuse", 0.0), ("polyfuse", 0.5), ("polyfuse+cuda_graph", 0.0), ("polyfuse+cuda_graph", 0.5),
        ("transformers", 0.0), ("transformers", 0.5), ("transformers", 0.0),
    ]  # fmt: skip
    assert [kw.get("pause", 0.0) for kw in timed] == [0.0, 0.5, 0.0, 0.5, 0.0, 0.5, 0.0]


@pytest.mark.slow
def test_benchmark_serving_tiny(tmp_path):
    """benchmark_serving.py at the tiny shape: polyfuse over HTTP, transformers' continuous batching and generate()
    at batch 1 on the same requests; every request completes with exactly its output length in both servers."""
    out, folder = tmp_path / "serve.jsonl", tmp_path / "results"
    folder.mkdir()
    from benchmarks.benchmark_serving import peer_missing

    if peer_missing("transformers"):  # transformers 4.x: one error line before any work, then nothing to compare
        cmd = [sys.executable, "benchmarks/benchmark_serving.py", "--shape", "tiny", "--peers", "transformers"]
        proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [f"error: {peer_missing('transformers')}"]
        pytest.skip(peer_missing("transformers"))
    _run([
        "benchmarks/benchmark_serving.py", "--shape", "tiny", "--num_prompts", "6", "--request_rate", "50",
        "--max_concurrency", "4", "--input_len_median", "12", "--output_len_median", "8", "--max_input_len", "40",
        "--max_output_len", "16", "--peers", "transformers,generate", "--output", str(out),
        "--results", str(folder),
    ])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["what"] for r in rows] == ["versions", "serving", "serving", "serving"]
    rows = rows[1:]
    assert [r["impl"] for r in rows] == ["polyfuse", "transformers", "generate_batch1"]
    serve, peer = rows[0], rows[1]
    for r in (serve, peer):
        assert r["completed"] == 6 and r["failed"] == 0 and r["output_tok_per_s"] > 0
        assert r["ttft_ms_p50"] > 0 and r["tpot_ms_p99"] >= r["tpot_ms_p50"] > 0
    assert serve["output_tokens"] == peer["output_tokens"] and serve["input_tokens"] == peer["input_tokens"]
    assert 0 < serve["kv_fill_at_busiest"] <= 1 and serve["kv_blocks_used_max"] > 0
    assert serve["clients"] == "own process" and peer["clients"] == "server process"
    assert rows[2]["tpot_ms_p50"] > 0
    # --results (a folder): the same figure rows in serving.jsonl with date, device, versions and command, in the
    # shape make_table.py pairs: equal settings, polyfuse beside its peers
    results = [json.loads(line) for line in (folder / "serving.jsonl").read_text().splitlines()]
    assert [r["impl"] for r in results] == ["polyfuse", "transformers", "generate_batch1"]
    assert list(results[0])[:3] == ["what", "date", "device"] and list(results[0])[-2:] == ["versions", "command"]
    for got, row in zip(results, rows):
        assert got["what"] == "serving" and got["device"] == "cpu" and got["date"][:4].isdigit()
        assert got["command"].startswith("python ") and "--results" in got["command"]
        assert {"torch", "transformers", "triton", "cuda"} <= set(got["versions"])
        assert {k: v for k, v in got.items() if k not in ("date", "device", "versions", "command")} == row
        assert got["shape"] == "tiny" and got["max_concurrency"] == 4 and got["request_rate"] == 50
    assert results[0]["output_tokens"] == results[1]["output_tokens"] == serve["output_tokens"]
    from benchmarks import make_table

    table = "\n".join(make_table.serving_table(make_table.load_rows(str(folder))))
    assert table.count("| tiny, fp32 | 4 (6 requests, Poisson 50/s) | HTTP, clients in their own process |") == 2
    assert "transformers continuous batching (sdpa)" in table and "polyfuse generate(), batch 1" in table


@pytest.mark.slow
def test_benchmark_serving_multi_step(tmp_path):
    """--num_scheduler_steps: the concurrency-1 comparison with generate() at batch 1, multi-step decoding on; the
    row says so and make_table.py keeps it apart from the single-step rows."""
    folder = tmp_path / "results"
    folder.mkdir()
    _run([
        "benchmarks/benchmark_serving.py", "--shape", "tiny", "--num_prompts", "3", "--max_concurrency", "1",
        "--input_len_median", "12", "--output_len_median", "9", "--max_input_len", "40", "--max_output_len", "16",
        "--peers", "generate", "--num_scheduler_steps", "4", "--results", str(folder),
    ])  # fmt: skip
    rows = [json.loads(line) for line in (folder / "serving.jsonl").read_text().splitlines()]
    assert [r["impl"] for r in rows] == ["polyfuse", "generate_batch1"]
    assert rows[0]["num_scheduler_steps"] == 4 and rows[0]["completed"] == 3 and rows[0]["failed"] == 0
    assert rows[0]["tpot_ms_p50"] > 0 and rows[1]["tpot_ms_p50"] > 0
    from benchmarks import make_table

    table = "\n".join(make_table.serving_table(make_table.load_rows(str(folder))))
    assert "HTTP, clients in their own process, 4 scheduler steps |" in table
