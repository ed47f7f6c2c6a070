#!/usr/bin/env python
"""Serving benchmark in the style of vLLM's benchmark_serving.py: polyfuse serve against transformers' continuous
batching, on the same random weights, in one run.

    python benchmarks/benchmark_serving.py --shape llama3-8b --bf16 --max_concurrency 64 --num_prompts 512 \
        --flags use_flash_attention,use_cuda_graphs                      # one GPU, the ShareGPT-like mix
    python benchmarks/benchmark_serving.py --shape llama3-8b --bf16 --max_concurrency 1 --num_prompts 16 \
        --flags use_flash_attention,use_cuda_graphs --peers ""          # batch-1 time per output token
    python benchmarks/benchmark_serving.py --shape tiny --num_prompts 8 --request_rate 20  # CPU smoke
    python benchmarks/benchmark_serving.py --shape llama3-8b --bf16 --max_concurrency 1 --num_prompts 8 \
        --flags use_flash_attention,use_cuda_graphs --peers generate --num_scheduler_steps 8   # multi-step

Requests arrive as a Poisson process at ``--request_rate`` per second (inf: all at once), at most
``--max_concurrency`` in flight. Prompt and output lengths are drawn from a ShareGPT-like distribution (log-normal,
seeded: medians 160 / 140 tokens, clipped to --max_input_len / --max_output_len; no download), prompts are random
token ids and every request generates exactly its output length (``ignore_eos``). polyfuse is driven over HTTP
(its OpenAI server on 127.0.0.1, streaming completions; ``--api engine``: the async engine directly); transformers
through ``init_continuous_batching`` (its streaming result handlers, what ``transformers serve`` uses), with the
model sharing polyfuse's weight storage. Reported per implementation: request throughput, output tokens/s, total
tokens/s, time to first token and time per output token (after the first) at p50 / p99 / mean, and for polyfuse the
KV blocks' fill at the busiest step. Rows go to stdout as JSON (and to --output); with --results, the figure rows
(``"what": "serving"``) with the date, device, versions and command go to benchmarks/results/serving.jsonl, which
benchmarks/make_table.py turns into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.harness.report import RowSink  # noqa: E402
from benchmarks.harness.shapes import config_for  # noqa: E402


@dataclass
class Req:
    index: int
    prompt: list
    output_len: int
    arrival: float  # seconds after the start


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    tpot: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""


def workload(args, vocab: int) -> list:
    """ShareGPT-like lengths (log-normal: ShareGPT's conversations have a long tail of long prompts and answers) and
    Poisson arrivals, all from --seed."""
    gen = torch.Generator().manual_seed(args.seed)

    def lengths(median, sigma, low, high):
        z = torch.randn(args.num_prompts, generator=gen, dtype=torch.float64)
        return [int(min(max(round(median * math.exp(sigma * float(v))), low), high)) for v in z]

    ins = lengths(args.input_len_median, 0.9, 4, args.max_input_len)
    outs = lengths(args.output_len_median, 0.8, 2, args.max_output_len)
    if math.isinf(args.request_rate):
        arrivals = [0.0] * args.num_prompts
    else:
        gaps = torch.empty(args.num_prompts, dtype=torch.float64).exponential_(args.request_rate, generator=gen)
        arrivals = torch.cumsum(gaps, 0).tolist()
        arrivals = [a - arrivals[0] for a in arrivals]
    return [
        Req(i, torch.randint(10, vocab - 1, (n,), generator=gen).tolist(), m, t)
        for i, (n, m, t) in enumerate(zip(ins, outs, arrivals))
    ]


async def drive(reqs: list, send, concurrency: int, desc: str) -> tuple:
    """Send each request at its arrival time (at most ``concurrency`` in flight); (results, seconds)."""
    from tqdm.auto import tqdm

    limit = asyncio.Semaphore(concurrency) if concurrency > 0 else None
    bar = tqdm(total=len(reqs), desc=desc, unit="req", file=sys.stderr, disable=not sys.stderr.isatty())
    start = time.perf_counter()

    async def one(req):
        delay = start + req.arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is None:
            res = await send(req)
        else:
            async with limit:
                res = await send(req)
        bar.update(1)
        return res

    results = await asyncio.gather(*(one(r) for r in reqs))
    bar.close()
    return results, time.perf_counter() - start


def summarize(impl: str, reqs: list, results: list, seconds: float, extra: dict) -> dict:
    ok = [r for r in results if r.ok]

    def pct(values, q):
        if not values:
            return None
        s = sorted(values)
        return round(1e3 * s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))], 3)

    ttft, tpot = [r.ttft for r in ok], [r.tpot for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(len(q.prompt) for q, r in zip(reqs, results) if r.ok)
    row = {
        "impl": impl, "completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(seconds, 3),
        "request_throughput": round(len(ok) / seconds, 3), "output_tok_per_s": round(out_tokens / seconds, 2),
        "total_tok_per_s": round((out_tokens + in_tokens) / seconds, 2),
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "ttft_ms_mean": round(1e3 * sum(ttft) / len(ttft), 3) if ttft else None,
        "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
        "tpot_ms_mean": round(1e3 * sum(tpot) / len(tpot), 3) if tpot else None,
        "output_tokens": out_tokens, "input_tokens": in_tokens,
    }  # fmt: skip
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        row["errors"] = errors[:3]
    row.update(extra)
    return row


class BenchTokenizer:
    """Random weights have no tokenizer: every id decodes to one CJK character, so every token is a streamed
    chunk (a real tokenizer's detokenization costs more host time than this)."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4E00 + i % 20000) for i in ids)

    def __call__(self, text, add_special_tokens=True):
        raise ValueError("the benchmark sends token ids")


# -- polyfuse ------------------------------------------------------------------------------------------------------------


def polyfuse_model(args, device):
    from polyfuse.models import AutoModelForCausalLM

    flags = {f: True for f in args.flags.split(",") if f}
    from polyfuse.core.flags import check_flags

    flags, warnings = check_flags(device.type, flags)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_config(config_for(args.shape), dtype=dtype, device=device, flags=flags,
                                             seed=args.seed)  # fmt: skip
    return model.eval()


def serve_args(args, max_len: int):
    from polyfuse.serving.cli import build_parser

    argv = [
        "--port",
        "0",
        "--max_num_seqs",
        str(args.max_num_seqs),
        "--max_model_len",
        str(max_len),
        "--max_num_batched_tokens",
        str(args.max_num_batched_tokens),
        "--block_size",
        str(args.block_size),
        "--gpu_memory_utilization",
        str(args.gpu_memory_utilization),
        "--max_waiting",
        str(10 * args.num_prompts),
    ]
    if args.num_kv_blocks:
        argv += ["--num_kv_blocks", str(args.num_kv_blocks)]
    return build_parser().parse_args(argv)  # fmt: skip


def run_polyfuse(args, model, reqs: list) -> dict:
    from polyfuse.serving.engine import Engine, EngineConfig
    from polyfuse.serving.server import make_server, size_cache

    max_len = max(len(r.prompt) + r.output_len for r in reqs)
    sargs = serve_args(args, max_len)
    blocks, max_len = size_cache(model, sargs)
    cfg = EngineConfig(max_len, blocks, args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                       seed=args.seed, num_scheduler_steps=args.num_scheduler_steps)  # fmt: skip
    engine = Engine(model, BenchTokenizer(), cfg)
    engine.runner.warmup()
    fills = []
    real_step = engine.step

    def step():
        out = real_step()
        if engine.blocks.num_used:
            fills.append((engine.blocks.num_used, engine.block_fill()))
        return out

    engine.step = step
    server, sock, aengine = make_server(engine, "bench", sargs)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = "http://%s:%d" % sock.getsockname()[:2]
    try:
        results, seconds = asyncio.run(_polyfuse_clients(args, reqs, url, aengine))
    finally:
        server.should_exit = True
        thread.join(60)
    busiest = max(fills) if fills else (0, 1.0)
    extra = {"kv_blocks": blocks - 1, "kv_blocks_used_max": busiest[0], "kv_fill_at_busiest": round(busiest[1], 4),
             "preemptions": engine.scheduler.preemptions, "api": args.api,
             "num_scheduler_steps": args.num_scheduler_steps,
             "clients": "own process" if args.api == "http" else "server process"}  # fmt: skip
    row = summarize("polyfuse", reqs, results, seconds, extra)
    engine.step = real_step  # the closure held the engine: let it go with the row
    return row


def _http_clients(url: str, reqs: list, concurrency: int, conn) -> None:
    """The HTTP clients, in a process of their own (as vLLM's benchmark is a separate client): their JSON parsing
    does not compete with the server for its interpreter lock. Sends (results, seconds) back through ``conn``."""
    conn.send(asyncio.run(_over_http(url, reqs, concurrency)))
    conn.close()


async def _over_http(url: str, reqs: list, concurrency: int):
    import httpx

    async def over_http(client, req):
        body = {"model": "bench", "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        t0 = time.perf_counter()
        first, tokens = None, 0
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return Result(False, error=f"HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif first is None and chunk["choices"]:
                        first = time.perf_counter()
        except httpx.HTTPError as e:
            return Result(False, error=type(e).__name__)
        end = time.perf_counter()
        return _result(t0, first, end, tokens)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        return await drive(reqs, lambda r: over_http(client, r), concurrency, "polyfuse")


async def _polyfuse_clients(args, reqs, url, aengine):
    from polyfuse.serving.request import SamplingParams

    async def direct(req):
        out: asyncio.Queue = asyncio.Queue()
        t0 = time.perf_counter()
        aengine.submit(req.prompt, SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True), out)
        first, tokens = None, 0
        while True:
            _, d = await out.get()
            if isinstance(d, Exception):
                return Result(False, error=str(d))
            first = first or time.perf_counter()
            tokens += len(d.token_ids)
            if d.finish_reason is not None:
                return _result(t0, first, time.perf_counter(), tokens)

    if args.api == "engine":
        return await drive(reqs, direct, args.max_concurrency, "polyfuse")
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    client = ctx.Process(target=_http_clients, args=(url, reqs, args.max_concurrency, there), daemon=True)
    client.start()
    while not here.poll():  # the server's event loop keeps running meanwhile
        await asyncio.sleep(0.05)
    results = here.recv()
    client.join(30)
    return results


def _result(t0, first, end, tokens) -> Result:
    if first is None or tokens == 0:
        return Result(False, error="no tokens")
    return Result(True, first - t0, (end - first) / max(tokens - 1, 1), end - t0, tokens)


# -- transformers' continuous batching -----------------------------------------------------------------------------------


def run_transformers(args, model, reqs: list) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from benchmarks.benchmark_generation import hf_twin

    hf = hf_twin(model)
    hf.set_attn_implementation(args.peer_attn)
    gen_cfg = GenerationConfig(max_new_tokens=args.max_output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kw = {}
    if model.device.type == "cpu":  # sized from the workload: its default sizing from host memory takes minutes
        kw = {"num_blocks": 2 * sum(-(-(len(r.prompt) + r.output_len) // 256) for r in reqs), "max_batch_tokens": 512}
    cb_cfg = ContinuousBatchingConfig(max_requests_per_batch=args.max_num_seqs, seed=args.seed, **kw)
    manager = hf.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    manager.warmup()
    manager.start()
    try:
        results, seconds = asyncio.run(_transformers_clients(args, reqs, manager))
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    row = summarize("transformers", reqs, results, seconds, {"attention": args.peer_attn, "clients": "server process"})
    del hf, manager
    return row


async def _transformers_clients(args, reqs, manager):
    async def send(req):
        out: asyncio.Queue = asyncio.Queue()
        rid = f"r{req.index}"
        manager.register_result_handler(rid, out.put_nowait)
        t0 = time.perf_counter()
        manager.add_request(req.prompt, request_id=rid, max_new_tokens=req.output_len, streaming=True,
                            eos_token_id=-1)  # fmt: skip
        first = None
        while True:
            res = await out.get()
            if res.error:
                return Result(False, error=str(res.error)[:80])
            if first is None and res.generated_tokens:
                first = time.perf_counter()
            if res.is_finished():
                return _result(t0, first, time.perf_counter(), req.output_len)

    return await drive(reqs, send, args.max_concurrency, "transformers")


# -- run_generation.py's path at batch 1 -------------------------------------------------------------------------------


def run_generate(args, model, reqs: list) -> dict:
    """polyfuse's generate() (what run_generation.py runs, with the same flags) at batch 1, one prompt of the
    median input length, the median output length: the time per output token a single stream can have."""
    from polyfuse.generation.hooks import PhaseTimer

    n, new = args.input_len_median, args.output_len_median
    ids = torch.randint(10, model.config.vocab_size - 1, (1, n), generator=torch.Generator().manual_seed(args.seed))
    ids = ids.to(model.device)
    tpots, ttfts = [], []
    for i in range(4):  # the first run captures the graphs
        timer = PhaseTimer(model.runtime)  # the device synchronized at generate()'s phase boundaries
        model.generate(ids, max_new_tokens=new, ignore_eos=True, hooks=timer, bucket_size=128)
        if i:
            tpots.append(timer.rest_s / max(timer.new_tokens - 1, 1))
            ttfts.append(timer.first_token_s)
    tpots.sort()
    ttfts.sort()
    return {"impl": "generate_batch1", "prompt_len": n, "new_tokens": new, "tpot_ms_p50": round(1e3 * tpots[1], 3),
            "ttft_ms_p50": round(1e3 * ttfts[1], 3), "output_tok_per_s": round(1 / tpots[1], 2)}  # fmt: skip


# -- main ------------------------------------------------------------------------------------------------------------------


PEERS = {"transformers": run_transformers, "generate": run_generate}


def peer_missing(peer: str):
    """Why this environment cannot run ``peer``, or None."""
    if peer == "transformers":
        from transformers.generation import configuration_utils

        if not hasattr(configuration_utils, "ContinuousBatchingConfig"):
            import transformers

            return f"the transformers peer needs transformers' ContinuousBatchingConfig (5.x); this is {transformers.__version__}"
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    a = p.add_argument
    a("--shape", default="tiny", help="a shape of benchmarks/harness/shapes.py (random weights)")
    a("--bf16", action="store_true", help="bfloat16 weights and cache (default float32)")
    a("--device", default="auto", choices=["auto", "cpu", "cuda", "hpu"])
    a("--flags", default="", help="polyfuse run flags, comma-separated (use_flash_attention,use_cuda_graphs)")
    a("--num_prompts", type=int, default=200)
    a("--request_rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)")
    a("--max_concurrency", type=int, default=0, help="requests in flight at most (0: no limit)")
    a("--input_len_median", type=int, default=160)
    a("--output_len_median", type=int, default=140)
    a("--max_input_len", type=int, default=1024)
    a("--max_output_len", type=int, default=1024)
    a("--max_num_seqs", type=int, default=64)
    a("--max_num_batched_tokens", type=int, default=2048)
    a("--block_size", type=int, default=16)
    a("--num_kv_blocks", type=int, default=0, help="polyfuse's KV blocks (0: from --gpu_memory_utilization)")
    a("--gpu_memory_utilization", type=float, default=0.85)
    a("--api", default="http", choices=["http", "engine"], help="drive polyfuse over HTTP or the engine directly")
    a(
        "--num_scheduler_steps",
        type=int,
        default=1,
        help="polyfuse's multi-step decoding (polyfuse serve --num_scheduler_steps): decode steps per host sync",
    )
    a(
        "--peers",
        default="transformers",
        help="comma-separated: transformers (its continuous batching), generate (polyfuse's generate() at batch 1)",
    )
    a("--peer_attn", default="sdpa", help="transformers' attention for its continuous batching")
    a("--seed", type=int, default=0)
    a("--output", default=None, help="append the JSON rows here")
    a(
        "--results",
        default=None,
        help="append the figure rows with date, device, versions and command to this "
        "JSON-lines file, or to serving.jsonl in this folder (benchmarks/results: docs/benchmarks.md is made from it)",
    )
    return p.parse_args(argv)


def settings(args) -> dict:
    """What a row's figures depend on besides the implementation: make_table.py sets the peers measured with the same
    settings beside polyfuse."""
    return {"what": "serving", "shape": args.shape, "dtype": "bfloat16" if args.bf16 else "float32",
            "flags": args.flags, "num_prompts": args.num_prompts,
            "request_rate": None if math.isinf(args.request_rate) else args.request_rate,  # None: all at once
            "max_concurrency": args.max_concurrency, "input_len_median": args.input_len_median,
            "output_len_median": args.output_len_median, "max_input_len": args.max_input_len,
            "max_output_len": args.max_output_len, "max_num_seqs": args.max_num_seqs, "seed": args.seed}  # fmt: skip


def versions_row(device) -> dict:
    row = {"what": "versions", "device": device.type, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}  # fmt: skip
    try:
        import transformers

        row["transformers"] = transformers.__version__
    except ImportError:
        pass
    return row


def log(row: dict, out: RowSink) -> None:
    print(json.dumps(row), flush=True)
    out.write(row)


def main(argv=None) -> int:
    args = parse_args(argv)
    from polyfuse.core.platform import default_device_type

    device = torch.device(default_device_type() if args.device == "auto" else args.device)
    peers = [p for p in args.peers.split(",") if p]
    for peer in peers:
        if peer not in PEERS:
            raise SystemExit(f"error: unknown peer {peer!r} ({', '.join(PEERS)})")
        if peer_missing(peer):
            raise SystemExit(f"error: {peer_missing(peer)}")
    out = RowSink(args.output, args.results, torch.cuda.get_device_name(device) if device.type == "cuda" else
                  device.type)  # fmt: skip
    log(versions_row(device), out)
    model = polyfuse_model(args, device)
    reqs = workload(args, model.config.vocab_size)
    rows = [{**settings(args), **run_polyfuse(args, model, reqs)}]
    log(rows[0], out)
    for peer in peers:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append({**settings(args), **PEERS[peer](args, model, reqs)})
        log(rows[-1], out)
    out.close()
    for row in rows[1:]:
        ratio = rows[0]["output_tok_per_s"] / row["output_tok_per_s"]
        tpot = rows[0]["tpot_ms_p50"] / row["tpot_ms_p50"] if row.get("tpot_ms_p50") else float("nan")
        print(f"polyfuse / {row['impl']}: output tokens/s {ratio:.2f}x, TPOT p50 {tpot:.2f}x", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
