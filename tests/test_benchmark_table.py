"""docs/benchmarks.md and README.md's results table are what benchmarks/make_table.py makes of benchmarks/results."""

import json
import os

from benchmarks import make_table
from benchmarks.harness.report import RESULT_FILES


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_benchmarks_md_is_generated_from_the_results():
    rows = make_table.load_rows()
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        committed = f.read()
    assert make_table.render_doc(rows) == committed, "run: python benchmarks/make_table.py"


def test_readme_table_is_generated_from_the_results():
    rows = make_table.load_rows()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert make_table.with_readme_table(readme, rows) == readme, "run: python benchmarks/make_table.py"
    assert make_table.readme_table(rows) in readme


def test_every_results_row_says_what_when_where_and_how():
    rows = make_table.load_rows()
    assert len(rows) > 100
    for r in rows:
        assert r["what"] in RESULT_FILES, r
        assert r["date"][:4].isdigit() and r["device"], r
        assert r.get("command") or r.get("source"), r


def test_latest_row_of_a_configuration_wins(tmp_path):
    """Rows are appended in time order: the table shows the last one of each configuration, its peers beside it."""
    base = {"what": "decode", "device": "NVIDIA H200", "shape": "llama3-8b", "bs": 1, "prompt_len": 128}
    rows = [
        dict(base, impl="polyfuse", tok_per_s=200.0, ms_per_step=5.0, date="2026-01-01"),
        dict(base, impl="transformers", mode="static_compile", tok_per_s=100.0, ms_per_step=10.0, date="2026-01-01"),
        dict(base, impl="polyfuse", tok_per_s=250.0, ms_per_step=4.0, date="2026-01-02"),
    ]
    (tmp_path / "decode.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ours, peers = make_table.decode_rows(make_table.load_rows(str(tmp_path)))
    lines = make_table.decode_table(ours, peers, gguf=False)
    body = [line for line in lines if line.startswith("| Llama-3-8B")]
    assert len(body) == 1
    assert "**250.0**" in body[0] and "transformers static cache + compile 100.0" in body[0] and "2.50x" in body[0]
    assert "2026-01-02" in body[0]


def test_serving_table_sets_the_peer_of_the_same_settings_beside_the_latest_polyfuse_run(tmp_path):
    settings = {"what": "serving", "device": "NVIDIA H100 80GB HBM3", "shape": "llama3-8b", "dtype": "bfloat16",
                "flags": "", "request_rate": None, "max_concurrency": 64, "num_prompts": 256, "api": "http"}  # fmt: skip
    rows = [
        dict(settings, impl="polyfuse", output_tok_per_s=500.0, tpot_ms_p50=60.0, date="2026-01-01"),
        dict(
            settings,
            impl="transformers",
            attention="sdpa",
            output_tok_per_s=300.0,
            tpot_ms_p50=120.0,
            tpot_ms_p99=150.0,
            date="2026-01-01",
        ),
        dict(settings, max_concurrency=8, impl="transformers", output_tok_per_s=100.0, date="2026-01-01"),
        dict(
            settings,
            impl="polyfuse",
            output_tok_per_s=900.0,
            tpot_ms_p50=40.0,
            request_throughput=4.5,
            kv_blocks=1000,
            kv_blocks_used_max=800,
            kv_fill_at_busiest=0.95,
            preemptions=0,
            clients="own process",
            date="2026-01-02",
        ),
    ]
    (tmp_path / "serving.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = make_table.serving_table(make_table.load_rows(str(tmp_path)))
    body = [line for line in lines if line.startswith("| Llama-3-8B")]
    assert body == [
        "| Llama-3-8B, bf16 | 64 (256 requests, all at once) | HTTP, clients in their own process | **900.0 (4.50 req/s)** "
        "| - / - | 40.00 / - | 800 of 1,000, 95.0% of their slots filled, 0 preempted | transformers continuous "
        "batching (sdpa) | 300.0 | - / - | 120.00 / 150.00 | tok/s 3.00x, TPOT p50 0.33x | H100 | 2026-01-02 |"
    ]
    (item,) = make_table.readme_serving_items(make_table.load_rows(str(tmp_path)))
    assert item[2] == "900.0 output tok/s" and item[5] == "3.00x"
