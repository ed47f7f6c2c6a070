#!/usr/bin/env python
"""Decode/prefill benchmark: polyfuse against transformers on the same random-weight shapes, in one process.

    python benchmarks/benchmark_generation.py --shapes llama3-8b --batch_sizes 1,16,64 --peers eager,static_compile
    python benchmarks/benchmark_generation.py   # on a CPU: the tiny shape (the defaults above are GPU-sized)
    torchrun --nproc-per-node 2 benchmarks/benchmark_generation.py --tp 2 --shapes llama3-8b,llama2-70b \
        --batch_sizes 1,16 --peer_batch_sizes 1 --load --checkpoint_dir /tmp/ckpt   # tensor parallel, rank 0 logs

Every number is measured in this run: the copy bandwidth that sets the ceiling, polyfuse, and the peers. The shapes
asked for are checked against the device's free memory first (one error line when they cannot fit), and a table of
the decode and prefill rows follows the JSON lines.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.harness.measure import copy_bandwidth, time_median, weight_bytes  # noqa: E402
from benchmarks.harness.memory_plan import check_memory, fill_defaults  # noqa: E402
from benchmarks.harness.report import RowSink  # noqa: E402
from benchmarks.harness.shapes import config_for  # noqa: E402
from benchmarks.harness.summary import summary  # noqa: E402
from polyfuse.compat import DTYPE_KW  # noqa: E402
from polyfuse.generation.hooks import PhaseTimer  # noqa: E402
from polyfuse.generation.kv_cache import ensure_cache  # noqa: E402
from polyfuse.generation.steps import StepModule  # noqa: E402
from polyfuse.loader.load import hf_state_items, set_kernels  # noqa: E402
from polyfuse.models import AutoModelForCausalLM  # noqa: E402
from polyfuse.ops.quant_formats import GGUF_BYTES  # noqa: E402
from polyfuse.quant.quantize import quantize_lm_head_  # noqa: E402


ROWS: list = []  # every row logged, for the table at the end


def log(row: dict, out) -> None:
    if os.environ.get("RANK", "0") != "0":  # under torchrun (--tp) rank 0 logs for every rank
        return
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    if out:
        out.write(row)


def gb(x):
    return round(x / 1e9, 3)


def hf_twin(model):
    """transformers' model of the same family sharing the polyfuse model's weight storage (no copy)."""
    import transformers

    with torch.device("meta"):
        hf = getattr(transformers, model.hf_architecture)(model.config)
    state = dict(hf_state_items(model))
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    hf.load_state_dict(state, assign=True, strict=False)
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    hf.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.clone()
    hf.model.rotary_emb.original_inv_freq = hf.model.rotary_emb.inv_freq.clone()
    hf.eval()
    return hf


def torchao_twin(model):
    """--quant's peer: transformers' model of the same shape with random weights, int8 weight-only by torchao (the
    issue's peer, run with a static cache + torch.compile like the others); its rows say peer_quant=torchao_int8.
    None, after one warning, where torchao is not installed: polyfuse's rows are still measured."""
    import transformers

    try:
        from torchao.quantization import quantize_
    except ImportError:
        print("warning: torchao is not installed: no transformers peer for --quant (polyfuse only)", file=sys.stderr)
        return None

    try:
        from torchao.quantization import Int8WeightOnlyConfig as int8_weight_only
    except ImportError:  # torchao < 0.9
        from torchao.quantization import int8_weight_only
    torch.manual_seed(0)
    with torch.device(model.device):
        hf = getattr(transformers, model.hf_architecture)(model.config).to(model.dtype)
    quantize_(hf, int8_weight_only())
    return hf.eval()


def decode_row(impl, shape, bs, ms, warm, peak, lengths=(None, None), **extra) -> dict:
    """One decode timing; ``lengths``: the prompt's and the new tokens' (benchmark settings the results keep)."""
    return dict(what="decode", impl=impl, **extra, shape=shape, bs=bs, tok_per_s=bs * 1e3 / ms, ms_per_step=ms,
                warmup_s=warm, mem_max_GB=gb(peak), prompt_len=lengths[0], new_tokens=lengths[1])  # fmt: skip


def prefill_attention(model) -> str:
    """The attention a cached prompt step runs: the first of the op's chain that takes any input (one-query decode
    kernels decline a prompt's queries; past the chain, the native reference), and, where the last layer attends from
    the last query only (``prune_last_layer``), what takes that one query when it differs."""
    choice = model.kernels.choices["attention"]
    chain = (choice.implementation, *choice.then)
    many = next((i.name for i in chain if i.accepts is None), "native")
    one = choice.implementation.name
    return f"{many} (last layer: {one})" if model.prune_last_layer and one != many else many


def prefill_row(impl, attention, shape, batch, length, seconds, extra_bytes, after_idle_s=0.0) -> dict:
    """One prefill timing; ``after_idle_s`` > 0: each timed prompt ran after that long with the GPU idle (the
    latency of one prompt on a GPU not held at its power limit), else the prompts ran back to back."""
    return dict(what="prefill", impl=impl, attention=attention, shape=shape, batch=batch, L=length,
                ms=1e3 * seconds, peak_extra_GB=gb(extra_bytes), after_idle_s=after_idle_s)  # fmt: skip


class StepTimer:
    """A logits processor that stamps each generation step (transformers syncs every step anyway)."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        self.stamps.append(time.perf_counter())
        return scores

    def decode_ms(self):
        import statistics

        d = [b - a for a, b in zip(self.stamps[1:], self.stamps[2:])]  # skip the prefill step
        return 1e3 * statistics.median(d)


def quant_label(args, batch: int, device) -> str:
    """A row's ``quant``: the format, +lm_head, +a8 where its decode steps' GEMVs run on int8 activations: one row on
    a CUDA device, with int4 and POLYFUSE_INT4_A8=1 or a GGUF type unless POLYFUSE_GGUF_A8=0 (batch > 1 and the
    prefill keep float activations)."""
    a8 = (args.quant == "int4" and os.environ.get("POLYFUSE_INT4_A8", "0") == "1") or (
        args.quant.startswith("gguf_") and os.environ.get("POLYFUSE_GGUF_A8", "1") != "0"
    )  # gemv_gptq_a8.ENABLED's / gemv_gguf_a8.ENABLED's source
    a8 = a8 and batch == 1 and torch.device(device).type == "cuda"
    head = "" if args.head_format in (None, args.quant) else f":{args.head_format}"
    return args.quant + ("+lm_head" + head if args.quant_lm_head else "") + ("+a8" if a8 else "")


def bench_polyfuse(model, batch, prompt_len, new_tokens, device):
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device)
    torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)  # warm-up: graph capture happens here
    warm = time.perf_counter() - t0
    timer = PhaseTimer(model.runtime)  # the device synchronized at generate()'s phase boundaries
    model.generate(ids, max_new_tokens=new_tokens, ignore_eos=True, hooks=timer)
    ms = 1e3 * timer.rest_s / (timer.new_tokens - 1)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return ms, warm, peak


def bench_hf(hf, mode, batch, prompt_len, new_tokens, device):
    from transformers import LogitsProcessorList

    ids = torch.randint(0, hf.config.vocab_size, (batch, prompt_len), device=device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    kw["attention_mask"] = torch.ones_like(ids)
    if mode == "static_compile":
        # transformers compiles the decoding forward itself (reduce-overhead, fullgraph) for a static cache.
        kw["cache_implementation"] = "static"
    torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, **kw)
        if mode == "static_compile":
            hf.generate(ids, **kw)  # reduce-overhead records graphs on the second call
    warm = time.perf_counter() - t0
    timer = StepTimer()
    with torch.inference_mode():
        hf.generate(ids, logits_processor=LogitsProcessorList([timer]), **kw)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return timer.decode_ms(), warm, peak


def _timed_peak(device, fn, **kw):
    """(median seconds, peak bytes allocated above what was allocated before) of ``fn``."""
    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    s = time_median(fn, **kw)
    return s, (torch.cuda.max_memory_allocated() - base) if cuda else 0


def bench_prefill(model, hf, length, batch, device, out, shape, idle_s=0.0):
    ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
    pos = torch.arange(length, device=device)[None].expand(batch, length)
    with torch.inference_mode():
        ensure_cache(model, batch, length)
        attention = prefill_attention(model)
        runs, step = [("polyfuse", lambda: model.step(ids, pos, pos[0], None, length))], None
        if model.flags.get("cuda_graph_prefill"):  # the prompt step as generate() runs it with the flag: a replay
            step = model.runtime.graph_module(StepModule(model), "prefill", model.flags)
            runs.append(("polyfuse+cuda_graph", functools.partial(step, length, ids, pos, pos[0], None)))
        for impl, fn in runs:
            s, extra = _timed_peak(device, fn, reps=5)
            log(prefill_row(impl, attention, shape, batch, length, s, extra), out)
            if idle_s > 0:
                s, extra = _timed_peak(device, fn, reps=5, pause=idle_s)
                log(prefill_row(impl, attention, shape, batch, length, s, extra, after_idle_s=idle_s), out)
        del runs, step, fn  # the prompt graph's memory goes back before the peers run
        model.cache = None
        if hf is not None:
            for attn in ("sdpa", "eager"):
                if attn == "eager" and batch * length > 8 * 4096:
                    continue
                hf.set_attn_implementation(attn)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                s, extra = _timed_peak(device, lambda: hf(ids), reps=3 if batch > 1 else 5, warmup=1)
                log(prefill_row("transformers", attn, shape, batch, length, s, extra), out)
                if idle_s > 0 and attn == "sdpa":
                    s, extra = _timed_peak(device, lambda: hf(ids), reps=5, warmup=1, pause=idle_s)
                    log(prefill_row("transformers", attn, shape, batch, length, s, extra, after_idle_s=idle_s), out)
            hf.set_attn_implementation("sdpa")


def profile_decode(model, device, new_tokens=16):
    """GPU time per kernel over eager decode steps (same kernels as the graph, without its launch savings)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, model.config.vocab_size, (1, 128), device=device)
    model.generate(ids, max_new_tokens=4, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60), flush=True)


def bench_load(model, device, out):
    import transformers

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as d:
        model.save_pretrained(d)
        del model
        torch.cuda.empty_cache()
        ours = []
        for _ in range(3):  # warm page cache (the files were just written); the first load also pins its buffers
            t0 = time.perf_counter()
            m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, device=device)
            ours.append(time.perf_counter() - t0)
            del m
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        h = transformers.LlamaForCausalLM.from_pretrained(d, **{DTYPE_KW: torch.bfloat16}, device_map=str(device))
        torch.cuda.synchronize()
        theirs = time.perf_counter() - t0
        del h
        log(dict(what="load_to_gpu_s", polyfuse=min(ours), polyfuse_runs=ours, transformers=theirs), out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Defaults None: benchmarks/harness/memory_plan.py fills them per device (GPU: llama3-8b,... ; CPU: tiny).
    p.add_argument("--shapes", default=None, help="comma list (GPU default llama3-8b,llama2-7b,llama2-13b; CPU: tiny)")
    p.add_argument("--batch_sizes", default=None, help="comma list (GPU default 1,16,64; CPU: 1,2)")
    p.add_argument("--prompt_len", type=int, default=None, help="(GPU default 128; CPU: 32)")
    p.add_argument("--new_tokens", type=int, default=None, help="(GPU default 256; CPU: 16)")
    p.add_argument(
        "--peers", default=None, help="transformers modes to run beside polyfuse ('' for none; default "
        "eager,static_compile; CPU: eager)"
    )  # fmt: skip
    p.add_argument("--peer_shapes", default=None, help="shapes on which the peers run (default llama3-8b; CPU: tiny)")
    p.add_argument("--peer_batch_sizes", default=None, help="(GPU default 1,16,64; CPU: 1)")
    p.add_argument("--flags", default="use_flash_attention,use_cuda_graphs", help="polyfuse run flags")
    p.add_argument("--ops", default="", help="polyfuse op overrides")
    p.add_argument(
        "--variants",
        default="",
        help="extra polyfuse decode runs, ';'-separated op-override sets added to --ops (e.g. "
        "'linear=triton_gemv,swiglu_linear=triton_gemv'); each is timed beside the default at every batch size",
    )
    p.add_argument(
        "--blas", default="", help="comma list of torch BLAS backends to time decode under (cublas, cublaslt)"
    )
    p.add_argument("--prefill", default=None, help="prefill lengths at batch 1 ('' for none; default 2048; CPU: 64)")
    p.add_argument(
        "--prefill_idle", type=float, default=0.0,
        help="also time each polyfuse prefill and transformers' SDPA prefill with the GPU idle this many seconds "
        "before every prompt (one prompt's latency; back to back, a GPU at its power limit runs at a lower clock)",
    )  # fmt: skip
    p.add_argument("--attn_memory", action="store_true", help="batch 8 x 4096 prefill memory, flash vs eager vs SDPA")
    p.add_argument("--block70b", action="store_true", help="Llama-2-70B single block decode, tokens/s per block")
    p.add_argument("--load", action="store_true", help="load time from a local safetensors folder, 8B shape")
    p.add_argument("--profile", action="store_true", help="print GPU time per kernel for eager batch-1 decode")
    p.add_argument("--output", default=None, help="append JSON lines here")
    p.add_argument("--results", default=None, help="append the figure rows (decode, prefill, load) with the date, "
                   "device, versions and command to this JSON-lines file, or to their kind's file in this folder "
                   "(benchmarks/results: docs/benchmarks.md is made from it)")  # fmt: skip
    p.add_argument(
        "--quant",
        default=None,
        choices=["fp8", "fp8_block", "int8", "int4", *GGUF_BYTES],
        help="polyfuse's projections quantized (random weights; gguf_*: llama.cpp's blocks, round to nearest); the "
        "transformers peer runs torchao int8 weight-only",
    )
    p.add_argument(
        "--quant_lm_head",
        nargs="?",
        const="same",
        default=None,
        metavar="FORMAT",
        help="with --quant: the LM head quantized too, in --quant's format or (with a GGUF type) in FORMAT, e.g. "
        "--quant gguf_q4_k --quant_lm_head gguf_q6_k as a Q4_K_M file holds it",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor parallel over N ranks: run under torchrun --nproc-per-node N"
    )
    p.add_argument("--checkpoint_dir", default=None, help="--tp: where the peer shapes' random checkpoint is written "
                   "once (rank 0, a child process) for --load and the transformers tp_plan peer")  # fmt: skip
    p.add_argument("--write_checkpoint", default=None, help=argparse.SUPPRESS)  # the child: write one, exit
    args = p.parse_args()
    if args.write_checkpoint:
        return write_checkpoint(args.write_checkpoint, args.shapes.split(",")[0])
    if args.quant_lm_head and not args.quant:
        print("benchmark_generation.py: error: --quant_lm_head: needs --quant", file=sys.stderr)
        sys.exit(2)
    if args.quant and args.quant.startswith("gguf_") and args.tp > 1 and args.load:
        print(f"benchmark_generation.py: error: --quant {args.quant}: random weights only (no --tp --load from a "
              "checkpoint)", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    if args.quant_lm_head not in (None, "same", args.quant) and not (
        args.quant.startswith("gguf_") and args.quant_lm_head in GGUF_BYTES
    ):
        print(f"benchmark_generation.py: error: --quant_lm_head {args.quant_lm_head}: a format of its own only for a "
              f"GGUF --quant, one of {', '.join(GGUF_BYTES)}", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    args.head_format = args.quant if args.quant_lm_head == "same" else args.quant_lm_head

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    plan_run(args, device, dtype)
    flags = {f: True for f in args.flags.split(",") if f}
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out = RowSink(args.output, args.results, gpu if args.tp == 1 else f"{args.tp} x {gpu}")
    if args.tp > 1:
        return bench_tp(args, device, dtype, flags, out)
    import transformers

    log(
        dict(
            what="versions",
            torch=torch.__version__,
            transformers=transformers.__version__,
            gpu=gpu,
            flags=sorted(flags),
        ),
        out,
    )
    bw = copy_bandwidth(device) if device.type == "cuda" else None
    log(dict(what="copy_bandwidth_TBps", value=bw / 1e12 if bw else None), out)
    peers = [m for m in args.peers.split(",") if m]
    lengths = (args.prompt_len, args.new_tokens)
    shapes = [s for s in args.shapes.split(",") if s]
    if args.block70b:
        shapes.append("llama2-70b-block")
    for shape in shapes:
        cfg = config_for(shape)
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, device=device, flags=flags, overrides=args.ops, quant=args.quant
        )
        if args.head_format:
            quantize_lm_head_(model, args.head_format)
        model.eval()
        wb = weight_bytes(model)
        wb_read = weight_bytes(model, exclude_embedding=True)
        log(
            dict(
                what="model",
                shape=shape,
                weight_GB=gb(wb),
                decode_read_GB=gb(wb_read),
                backends={k: v["implementation"] for k, v in model.kernels.as_dict().items()},
                quant=args.quant,
                # --quant: what a declined call tries next (rows decide: gemv_q 1, gemm_q 2..64, dequant_mm more)
                quant_chains={
                    op: [c.implementation.name] + [i.name for i in c.then]
                    for op, c in model.kernels.choices.items()
                    if op in ("linear_q", "swiglu_linear_q", "add_rms_norm_linear_q") and args.quant
                },
            ),
            out,
        )
        if args.profile and device.type == "cuda":
            set_kernels(model, {k: v for k, v in flags.items() if k != "use_cuda_graphs"}, args.ops)
            profile_decode(model, device)
            set_kernels(model, flags, args.ops)
        twin = torchao_twin if args.quant else hf_twin  # --quant: the peer is torchao's int8 weight-only
        hf = twin(model) if (peers and shape in args.peer_shapes.split(",")) or args.prefill else None
        batch_sizes = [1] if shape == "llama2-70b-block" else [int(b) for b in args.batch_sizes.split(",")]
        variants = [(blas, ops) for blas in (args.blas.split(",") if args.blas else [""]) for ops in [""] + [
            v for v in args.variants.split(";") if v]]  # fmt: skip
        for bs in batch_sizes:
            for blas, extra in variants:
                if blas:
                    torch.backends.cuda.preferred_blas_library(blas)
                if blas or extra:  # a fresh resolution also drops graphs captured under other kernels
                    set_kernels(model, flags, ",".join(o for o in (args.ops, extra) if o))
                ms, warm, peak = bench_polyfuse(model, bs, args.prompt_len, args.new_tokens, device)
                kv = model.cache.nbytes() if model.cache is not None else 0
                row = decode_row("polyfuse", shape, bs, ms, warm, peak, lengths, flags=sorted(flags))
                if args.quant:
                    row["quant"] = quant_label(args, bs, device)
                if blas or extra:
                    row["variant"] = ";".join(x for x in (blas, extra) if x)
                if bw:
                    row["weight_GB"], row["copy_bandwidth_TBps"] = gb(wb), bw / 1e12
                    row["frac_of_limit_weights"] = (wb / bw * 1e3) / ms  # the definition: weights / bandwidth
                    row["achieved_TBps"] = (wb_read + kv) / (ms / 1e3) / 1e12  # bytes actually read per step
                log(row, out)
                model.cache = None
            if len(variants) > 1:
                torch.backends.cuda.preferred_blas_library("cublas")
                set_kernels(model, flags, args.ops)
            if hf is not None and shape in args.peer_shapes.split(",") and str(bs) in args.peer_batch_sizes.split(","):
                for mode in peers:
                    try:
                        hms, hwarm, hpeak = bench_hf(hf, mode, bs, args.prompt_len, args.new_tokens, device)
                    except Exception as e:  # a peer failing must not lose polyfuse's numbers
                        log(
                            dict(
                                what="decode", impl="transformers", mode=mode, shape=shape, bs=bs, error=str(e)[:300]
                            ),
                            out,
                        )
                        continue
                    peer_quant = {"peer_quant": "torchao_int8"} if args.quant else {}
                    log(
                        decode_row("transformers", shape, bs, hms, hwarm, hpeak, lengths, mode=mode, **peer_quant), out
                    )
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if shape == "llama2-70b-block" and hf is not None:
            layer = hf.model.layers[0]
            x = torch.randn(1, 1, cfg.hidden_size, device=device, dtype=dtype)
            pos = torch.zeros(1, 1, dtype=torch.long, device=device)
            with torch.inference_mode():
                pe = hf.model.rotary_emb(x, pos)
                s = time_median(lambda: layer(x, position_embeddings=pe, attention_mask=None), reps=50)
            log(
                dict(
                    what="block_decode",
                    impl="transformers",
                    mode="eager_nocache",
                    ms=1e3 * s,
                    tokens_per_s_per_block=1 / s,
                ),
                out,
            )
        if shape == "llama3-8b" or (shape == shapes[0] and device.type == "cpu"):
            for L in [int(x) for x in args.prefill.split(",") if x]:
                bench_prefill(model, hf, L, 1, device, out, shape, args.prefill_idle)
            if args.attn_memory:
                bench_prefill(model, hf, 4096, 8, device, out, shape)
                # same model, eager attention for the comparison:
                set_kernels(model, {k: v for k, v in flags.items() if k != "use_flash_attention"}, args.ops)
                bench_prefill(model, None, 4096, 8, device, out, shape)
                set_kernels(model, flags, args.ops)
        del hf
        if args.load and shape == "llama3-8b" and device.type == "cuda" and not args.quant:
            bench_load(model, device, out)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if out:
        out.close()
    print_summary()


def plan_run(args, device, dtype) -> None:
    """The device's defaults for the options not given, then the memory check (not for --tp: each rank holds a
    shard, checked by its own build): one warning or one error line."""
    note = fill_defaults(args, device)
    if note:
        print(f"benchmark_generation.py: {note}", file=sys.stderr)
    error = None if args.tp > 1 else check_memory(args, device, dtype)
    if error:
        print(f"benchmark_generation.py: {error}", file=sys.stderr)
        sys.exit(2)


def print_summary() -> None:
    text = summary(ROWS)
    if text:
        print("\n" + text, flush=True)


# -- tensor parallelism (--tp N under torchrun; docs/distributed.md) ---------------------------------------------


def rss_bytes() -> int:
    """Peak resident host memory of this process so far (Linux reports kB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gather(tp, value) -> list:
    """``value`` of every rank, in rank order (on every rank)."""
    import torch.distributed as dist

    values = [None] * tp.world_size
    dist.all_gather_object(values, value, group=tp.group)
    return values


def write_checkpoint(path: str, shape: str) -> None:
    """One process, one device: random weights of ``shape`` in bf16 (CPU: fp32) saved as a transformers folder."""
    from polyfuse import distributed

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config_for(shape), dtype=dtype, device=device)
    assert model.tp is distributed.SINGLE
    model.save_pretrained(path)


def ensure_checkpoint(args, shape: str, tp) -> str:
    """The random checkpoint of ``shape`` under --checkpoint_dir, written by rank 0 in a child process (so no rank's
    host memory peak includes the writing) when it is not there yet."""
    import subprocess

    import torch.distributed as dist

    path = os.path.join(args.checkpoint_dir, shape)
    if tp.rank == 0 and not os.path.isfile(os.path.join(path, "config.json")):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        cmd = [sys.executable, os.path.abspath(__file__), "--write_checkpoint", path, "--shapes", shape]
        subprocess.run(cmd, check=True, env=env)
    dist.barrier(group=tp.group)
    return path


def allreduce_ms_per_token(model, batch: int, device, reps: int = 20) -> float:
    """The decode step's collectives alone, through the registry's ``all_reduce``: two per layer on [batch, 1,
    hidden] and one on the [batch, vocab] logits, captured in one CUDA graph as in the graphed step; ms per replay
    is the all-reduce time per token (CPU: timed eagerly)."""
    cfg, group, op = model.config, model.tp.group, model.kernels.all_reduce
    h = torch.zeros(batch, 1, cfg.hidden_size, device=device, dtype=model.dtype)
    logits = torch.zeros(batch, cfg.vocab_size, device=device, dtype=model.dtype)

    def body():
        for _ in range(2 * cfg.num_hidden_layers):
            op(h, group)
        op(logits, group)

    if device.type != "cuda":
        return 1e3 * time_median(body, reps=3, warmup=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # eager warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return 1e3 * time_median(graph.replay, reps=reps)


def hf_tp_auto() -> dict:
    """transformers' tensor parallelism, ``tp_plan="auto"``: through ``DistributedConfig`` where it takes it (the
    bare keyword is deprecated there), else the keyword."""
    import inspect

    import transformers

    config = getattr(transformers, "DistributedConfig", None)
    if config is not None and "tp_plan" in inspect.signature(config).parameters:
        return {"distributed_config": config(tp_plan="auto")}
    return {"tp_plan": "auto"}


def bench_tp(args, device, dtype, flags, out) -> None:
    """Every rank builds its shard on its device (random weights drawn per shard, or --load: read from the random
    checkpoint with each rank's slices), decodes the same random prompts; rank 0 logs tokens/s, all-reduce ms per
    token, and per rank: shard size, peak device memory, peak host RSS. Peers: transformers' tp_plan="auto" on the
    peer shapes, in the same run."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <rank>`: where a rank is, for a report
    import transformers

    from polyfuse import distributed

    tp = distributed.init(device)
    if tp.world_size != args.tp:
        raise SystemExit(
            f"error: --tp {args.tp} needs torchrun --nproc-per-node {args.tp} (world size is {tp.world_size})"
        )
    device, cuda = tp.device, tp.device.type == "cuda"
    torch.manual_seed(0)  # every rank draws the same prompts
    log(dict(what="versions", torch=torch.__version__, transformers=transformers.__version__, tp=tp.world_size,
             backend=tp.backend, gpu=torch.cuda.get_device_name(device) if cuda else "cpu", flags=sorted(flags),
             env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}), out)  # fmt: skip
    peers = [m for m in args.peers.split(",") if m]
    lengths = (args.prompt_len, args.new_tokens)
    for shape in [s for s in args.shapes.split(",") if s]:
        cfg = config_for(shape)
        on_disk = shape in args.peer_shapes.split(",") and args.checkpoint_dir and (peers or args.load)
        ckpt = ensure_checkpoint(args, shape, tp) if on_disk else None
        rss_before, t0 = rss_bytes(), time.perf_counter()
        if ckpt is not None and args.load:
            model = AutoModelForCausalLM.from_pretrained(
                ckpt, dtype=dtype, device=device, flags=flags, overrides=args.ops, quant=args.quant
            )
        else:
            model = AutoModelForCausalLM.from_config(
                cfg, dtype=dtype, device=device, flags=flags, overrides=args.ops, quant=args.quant
            )
        if args.head_format:
            quantize_lm_head_(model, args.head_format)
        if cuda:
            torch.cuda.synchronize(device)
        ranks = gather(tp, dict(build_s=round(time.perf_counter() - t0, 2), shard_GB=gb(weight_bytes(model)),
                                rss_before_GB=gb(rss_before), rss_peak_GB=gb(rss_bytes())))  # fmt: skip
        log(dict(what="tp_model", shape=shape, tp=tp.world_size, source="safetensors" if ckpt and args.load else
                 "random per shard", backends={k: v["implementation"] for k, v in model.kernels.as_dict().items()},
                 per_rank=ranks), out)  # fmt: skip
        model.eval()
        variants = [""] + [v for v in args.variants.split(";") if v]  # e.g. "all_reduce=native": NCCL only
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            for extra in variants:
                if len(variants) > 1:  # a fresh resolution also drops graphs captured under other kernels
                    set_kernels(model, flags, ",".join(o for o in (args.ops, extra) if o))
                ms, warm, peak = bench_polyfuse(model, bs, args.prompt_len, args.new_tokens, device)
                model.cache = None
                ar = allreduce_ms_per_token(model, bs, device)
                peaks = gather(tp, gb(peak))
                row = decode_row("polyfuse", shape, bs, ms, warm, max(peaks) * 1e9, lengths, flags=sorted(flags),
                                 tp=tp.world_size, allreduce_ms_per_token=round(ar, 4), mem_max_GB_per_rank=peaks,
                                 host_rss_peak_GB_per_rank=gather(tp, gb(rss_bytes())),
                                 all_reduce=model.kernels.as_dict()["all_reduce"]["implementation"])  # fmt: skip
                if extra:
                    row["variant"] = extra
                if args.quant:
                    row["quant"] = quant_label(args, bs, device)
                log(row, out)
        del model
        if cuda:
            torch.cuda.empty_cache()
        if ckpt is None or not peers:
            continue
        hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, **hf_tp_auto(), **{DTYPE_KW: dtype}).eval()
        for bs in [int(b) for b in args.peer_batch_sizes.split(",")]:
            for mode in peers:
                try:
                    hms, hwarm, hpeak = bench_hf(hf, mode, bs, args.prompt_len, args.new_tokens, device)
                except Exception as e:  # a peer failing must not lose polyfuse's numbers
                    log(dict(what="decode", impl="transformers", mode=mode, tp_plan="auto", shape=shape, bs=bs,
                             error=str(e)[:300]), out)  # fmt: skip
                    continue
                row = decode_row("transformers", shape, bs, hms, hwarm, hpeak, lengths, mode=mode, tp_plan="auto")
                if args.quant:  # the peer is the bf16 checkpoint (no quantized tp_plan peer here)
                    row["peer_quant"] = "none"
                log(row, out)
        del hf
        if cuda:
            torch.cuda.empty_cache()
    distributed.shutdown()
    if out:
        out.close()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter teardown, where gloo can abort when a peer exits at the same time


if __name__ == "__main__":
    main()
