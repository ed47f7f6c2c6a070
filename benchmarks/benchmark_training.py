#!/usr/bin/env python
"""Training-step benchmark: polyfuse against transformers' own Llama (attn_implementation="sdpa") and against
Liger-Kernel (``apply_liger_kernel_to_llama`` on transformers' Llama) in one run.

Same shape, sequence, batch, bf16 weights and fused AdamW for every variant; random weights in real shapes. Liger
patches transformers' Llama class when applied, so the liger variant always runs last. A step is what
transformers' Trainer does per batch: forward with labels, backward, clip grad norm, optimizer step, zero grad.
Reports tokens/s, peak memory and (GPU) the longest sequence that fits, found by doubling until OOM, then one
polyfuse/transformers ratio line per (shape, seq, batch) that both variants measured. With --output the JSON is
rewritten after every case, so a run killed part-way keeps what it measured.

    python benchmarks/benchmark_training.py --output bench_training.json              # GPU default set
    python benchmarks/benchmark_training.py --batch 1,4,8 --gradient_checkpointing --time_budget_s 480 --output b.json
    python benchmarks/benchmark_training.py --shape llama-3.2-1b --seq 2048 --batch 4,8 --gradient_checkpointing \
        --variants transformers,polyfuse,liger --memory_peak --output b.json   # against Liger, with peak breakdown
    python benchmarks/benchmark_training.py --shape tiny --output /tmp/tiny.json      # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time


os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.harness.report import append_result, markdown_row, run_meta, write_json  # noqa: E402


def _shape(hidden, layers, heads, kv_heads, intermediate, vocab, tied):
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
    }


SHAPES = {
    "tiny": _shape(64, 2, 4, 2, 128, 256, True),
    "llama-3.2-1b": _shape(2048, 16, 32, 8, 8192, 128256, True),
    "llama-3-8b": _shape(4096, 32, 32, 8, 14336, 128256, False),
}


VARIANTS = ("transformers", "polyfuse", "liger")


def _fail(msg: str):
    print(f"benchmark_training.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="benchmark_training.py", description=__doc__.splitlines()[0])
    p.error = _fail
    p.add_argument("--shape", default=None, help=f"comma list of {', '.join(SHAPES)} (GPU default: 1b and 8b)")
    p.add_argument("--seq", default=None, help="comma list of sequence lengths (default 2048,4096; tiny: 64,128)")
    p.add_argument(
        "--batch",
        default="1",
        help="comma list of batch sizes (default 1); the longest-sequence search runs at the first one only",
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up step)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu")
    p.add_argument("--max_seq_cap", type=int, default=32768, help="stop the doubling search here")
    p.add_argument("--no_max_seq", action="store_true", help="skip the longest-sequence search")
    p.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="enable gradient checkpointing on both variants (transformers: use_reentrant=False)",
    )
    p.add_argument(
        "--time_budget_s",
        type=float,
        default=None,
        help="start no new case (or longest-sequence step) once this many seconds have passed; the rest is listed "
        "as skipped (default: no budget)",
    )
    p.add_argument(
        "--variants",
        default="transformers,polyfuse",
        help="comma list of transformers, polyfuse, liger (liger needs the liger-kernel package; it runs last)",
    )
    p.add_argument("--polyfuse_ops", default="", help="registry overrides for the polyfuse variant")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.add_argument(
        "--results",
        default=None,
        help="append each case with the date, device, versions and command to this JSON-lines file, or to training.jsonl in this folder (benchmarks/results)",
    )
    p.add_argument(
        "--profile", action="store_true", help="GPU: print the top kernels of one more step after each case"
    )
    p.add_argument(
        "--memory_peak",
        action="store_true",
        help="GPU: after each case, one more step with the allocator's history on; prints (and stores) what was "
        "alive at its peak, by allocating code",
    )
    a = p.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        _fail("--device cuda asked for but no CUDA GPU is available")
    shapes = a.shape or ("llama-3.2-1b,llama-3-8b" if a.device.startswith("cuda") else "tiny")
    a.shapes = [s.strip() for s in shapes.split(",") if s.strip()]
    for s in a.shapes:
        if s not in SHAPES:
            _fail(f"unknown --shape {s!r} (choose from {', '.join(SHAPES)})")
    seq = a.seq or ("64,128" if a.shapes == ["tiny"] else "2048,4096")
    try:
        a.seqs = [int(s) for s in seq.split(",") if s.strip()]
    except ValueError:
        _fail(f"--seq must be a comma list of integers, got {seq!r}")
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in a.variants:
        if v not in VARIANTS:
            _fail(f"unknown variant {v!r} ({', '.join(VARIANTS)})")
    if "liger" in a.variants:
        try:
            import liger_kernel.transformers  # noqa: F401
        except ImportError:
            _fail("--variants liger needs the liger-kernel package (pip install liger-kernel)")
        a.variants = [v for v in a.variants if v != "liger"] + ["liger"]  # it patches transformers' Llama class
    try:
        a.batches = [int(b) for b in a.batch.split(",") if b.strip()]
    except ValueError:
        _fail(f"--batch must be a comma list of integers, got {a.batch!r}")
    if not a.batches or min(a.batches) < 1 or a.steps < 1:
        _fail("--batch sizes and --steps must be at least 1")
    if not a.seqs or min(a.seqs) < 1:
        _fail("--seq lengths must be at least 1")
    if a.time_budget_s is not None and a.time_budget_s <= 0:
        _fail("--time_budget_s must be positive")
    a.torch_dtype = getattr(torch, a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"))
    return a


def build(variant: str, shape: str, args, max_seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=max(max_seq, 4096), attn_implementation="sdpa")
    device = torch.device(args.device)
    flags = {"use_flash_attention": True}
    if variant == "polyfuse":
        try:
            from polyfuse.models.llama import LlamaForCausalLM as PfLlama
        except ImportError:
            PfLlama = None
        if PfLlama is not None and hasattr(PfLlama, "from_config"):
            model = PfLlama.from_config(
                cfg, dtype=args.torch_dtype, device=device, flags=flags, overrides=args.polyfuse_ops, training=True
            )
            return model, model.kernels.report(), "polyfuse LlamaForCausalLM"
    old = torch.get_default_dtype()
    torch.set_default_dtype(args.torch_dtype)
    try:
        with device:
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    if variant == "polyfuse":
        from polyfuse.patch import patch

        h = patch(model, device=device, flags=flags, overrides=args.polyfuse_ops, training=True)
        return model, h.report(), "transformers LlamaForCausalLM + polyfuse.patch"
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        # Liger's defaults for Llama: RoPE, RMSNorm, SwiGLU and the fused linear cross-entropy (no logits).
        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True, model=model
        )
        return model, "", "transformers LlamaForCausalLM (sdpa) + Liger-Kernel"
    return model, "", "transformers LlamaForCausalLM (sdpa)"


def make_optimizer(model, device):
    fused = device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)


def step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# Kernel names by kind, for --profile's summary line: cuBLAS / CUTLASS matrix products (on Hopper cuBLAS's own
# kernels are named nvjet_*), attention (flash / SDPA / polyfuse's Triton attention); everything else is "other".
KERNEL_KINDS = (("matmul", ("nvjet", "gemm", "xmma", "cutlass", "cublas")), ("attention", ("flash", "fmha", "attn")))


def kernel_kinds(events) -> dict:
    """GPU milliseconds of one profiled step by kind of kernel (``KERNEL_KINDS``; the rest under "other")."""
    out = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for e in events:
        ms = (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)) / 1e3
        name = e.key.lower()
        out[next((kind for kind, keys in KERNEL_KINDS if any(k in name for k in keys)), "other")] += ms
    return {k: round(v, 2) for k, v in out.items()}


def profile_step(model, opt, args, seq: int, batch: int, title: str) -> dict:
    """GPU time per kernel over one training step (after the timed ones); returns its kernel_kinds summary."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=args.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(model, opt, ids)
        sync(torch.device(args.device))
    events = prof.key_averages()
    kinds = kernel_kinds(events)
    print(f"profile: {title}", flush=True)
    print(events.table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70), flush=True)
    total = sum(kinds.values())
    print(f"profile: {title}: GPU time {total:.1f} ms = " + ", ".join(
        f"{k} {v:.1f} ms ({100 * v / max(total, 1e-9):.0f}%)" for k, v in kinds.items()), flush=True)  # fmt: skip
    return kinds


def memory_peak_step(model, opt, args, seq: int, batch: int, title: str) -> str:
    """One more step with the allocator's history on: what was alive at its peak, by allocating code."""
    from benchmarks.harness import memory_peak

    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=args.device)
    sync(torch.device(args.device))
    before = torch.cuda.memory_allocated()
    memory_peak.record()
    try:
        step(model, opt, ids)
        sync(torch.device(args.device))
        text = f"{title}\n" + memory_peak.peak_report(before)
    except SystemError as e:
        # torch 2.11 on the H200: with the allocator's Python stacks recorded, a custom autograd Function applied
        # inside activation checkpointing's recompute failed ("returned NULL without setting an exception"); the
        # breakdown is skipped, the timed numbers of the case stand.
        text = f"{title}\nmemory peak: breakdown unavailable ({type(e).__name__}: {str(e)[:120]})"
        model.zero_grad(set_to_none=True)
    finally:
        memory_peak.stop()
    print(text, flush=True)
    return text


def run_case(model, opt, args, seq: int, batch: int, steps: int):
    device = torch.device(args.device)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step(model, opt, ids)  # warm-up (kernel compilation, optimizer state allocation)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(model, opt, ids)
    sync(device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {
        "tokens_per_s": round(batch * seq * steps / dt, 1),
        "step_s": round(dt / steps, 4),
        "peak_mem_gib": None if peak is None else round(peak, 2),
        "loss": round(float(loss.detach()), 4),
    }


def _free(opt=None, model=None):
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Budget:
    """``--time_budget_s``: once spent, ``over()`` is true and what was not started is listed in ``skipped``."""

    def __init__(self, seconds):
        self.seconds, self.t0, self.skipped = seconds, time.perf_counter(), []

    def over(self) -> bool:
        return self.seconds is not None and time.perf_counter() - self.t0 > self.seconds

    def skip(self, what: str) -> None:
        self.skipped.append(what)


def longest_seq(model, opt, args, start: int, budget: Budget):
    """Double the sequence from ``start`` until OOM (one step each, at the first batch size); the last that fit, or
    None if none did. Stops early, without a verdict, when the time budget runs out."""
    fit, seq = None, start
    while seq <= args.max_seq_cap:
        if budget.over():
            return fit, False
        oom = False
        try:
            run_case(model, opt, args, seq, args.batches[0], 1)
            fit = seq
        except torch.cuda.OutOfMemoryError:
            oom = True
        if oom:  # freed outside the except block, so the traceback no longer holds the activations
            _free(opt, model)
            break
        seq *= 2
    return fit, True


def _ratio(a, b):
    return None if a is None or b is None or not b else round(a / b, 3)


def ratios(cases):
    """polyfuse/peer tokens/s and peak-memory ratios for every (shape, seq, batch) that polyfuse and a peer
    (transformers, liger) both measured."""
    by = {(c["shape"], c["variant"], c["seq"], c["batch"]): c for c in cases if "tokens_per_s" in c}
    out = []
    for (shape, variant, seq, batch), pf in by.items():
        if variant != "polyfuse":
            continue
        for peer in ("transformers", "liger"):
            other = by.get((shape, peer, seq, batch))
            if other is None:
                continue
            out.append({
                "shape": shape, "seq": seq, "batch": batch, "peer": peer,
                "tokens_per_s_ratio": _ratio(pf["tokens_per_s"], other["tokens_per_s"]),
                "peak_mem_ratio": _ratio(pf["peak_mem_gib"], other["peak_mem_gib"]),
            })  # fmt: skip
    return out


def ratio_line(r) -> str:
    mem = "n/a" if r["peak_mem_ratio"] is None else f"{r['peak_mem_ratio']:.2f}x"
    return (f"ratio {r['shape']} seq {r['seq']} batch {r['batch']}: polyfuse/{r['peer']} tokens/s "
            f"{r['tokens_per_s_ratio']:.2f}x, peak memory {mem}")  # fmt: skip


def markdown(results) -> str:
    ckpt = "yes" if results["gradient_checkpointing"] else "no"
    table = [
        "| shape | variant | batch | seq | grad ckpt | tokens/s | peak GiB | step s | longest seq |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    maxes = {}
    for c in results["cases"]:
        if c.get("max_seq") is not None:
            maxes[c["shape"], c["variant"]] = f">={c['max_seq']}" if c.get("max_seq_lower_bound") else c["max_seq"]
    for c in results["cases"]:
        if "seq" not in c:
            continue
        longest = maxes.get((c["shape"], c["variant"]))
        cells = [c["shape"], c["variant"], c["batch"], c["seq"], ckpt, c.get("tokens_per_s", c.get("error")),
                 c.get("peak_mem_gib"), c.get("step_s"), longest if longest is not None else "n/a"]  # fmt: skip
        table.append(markdown_row(cells))
    return "\n".join(table)


def write(results, path) -> None:
    """Rewrite the JSON (atomically: a kill mid-write leaves the previous version) with the table and ratios."""
    if not path:
        return
    results["ratios"] = ratios(results["cases"])
    results["markdown"] = markdown(results)
    write_json(results, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = Budget(args.time_budget_s)
    device = torch.device(args.device)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(args.torch_dtype)[6:],
               "batches": args.batches, "steps": args.steps, "gradient_checkpointing": args.gradient_checkpointing,
               "time_budget_s": args.time_budget_s, "skipped": budget.skipped, "cases": []}  # fmt: skip
    search = device.type == "cuda" and not args.no_max_seq
    meta = run_meta(results["device"]) if args.results else None
    for shape in args.shapes:
        for variant in args.variants:
            grid = [(b, s) for b in args.batches for s in args.seqs]
            if budget.over():
                budget.skipped.extend(f"{shape}/{variant} batch {b} seq {s}" for b, s in grid)
                if search:
                    budget.skip(f"{shape}/{variant} longest-seq search")
                continue
            torch.manual_seed(0)
            oom = False
            try:
                model, report, impl = build(variant, shape, args, max(args.seqs))
            except torch.cuda.OutOfMemoryError:
                oom = True
            if oom:
                results["cases"].append({"shape": shape, "variant": variant, "error": "OOM building the model"})
                _free()
                write(results, args.output)
                continue
            if report:
                print(report, flush=True)
            if args.gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            opt = make_optimizer(model, device)
            for batch, seq in grid:
                if budget.over():
                    budget.skip(f"{shape}/{variant} batch {batch} seq {seq}")
                    continue
                case = {"shape": shape, "variant": variant, "impl": impl, "batch": batch, "seq": seq,
                        "gradient_checkpointing": args.gradient_checkpointing}  # fmt: skip
                oom = False
                try:
                    case.update(run_case(model, opt, args, seq, batch, args.steps))
                except torch.cuda.OutOfMemoryError:
                    oom = True
                if oom:  # one case out of memory does not stop the sweep
                    case["error"] = "OOM"
                    _free(opt, model)
                results["cases"].append(case)
                print(json.dumps(case), flush=True)
                write(results, args.output)
                append_result(args.results, {"what": "train_step", "dtype": results["dtype"], **case}, meta)
                if args.profile and not oom and device.type == "cuda":
                    title = f"{shape} {variant} batch {batch} seq {seq}"
                    case["profile_ms"] = profile_step(model, opt, args, seq, batch, title)
                    write(results, args.output)
                if args.memory_peak and not oom and device.type == "cuda":
                    case["memory_peak"] = memory_peak_step(
                        model, opt, args, seq, batch, f"{shape} {variant} batch {batch} seq {seq}"
                    )
                    write(results, args.output)
            row_max, finished = None, True
            if search:
                fitted = [
                    c["seq"]
                    for c in results["cases"]
                    if c["shape"] == shape and c["variant"] == variant and c.get("batch") == args.batches[0]
                    and "error" not in c
                ]  # fmt: skip
                if budget.over():
                    budget.skip(f"{shape}/{variant} longest-seq search")
                else:
                    start = max(fitted) * 2 if fitted else max(min(args.seqs) // 2, 1)
                    row_max, finished = longest_seq(model, opt, args, start, budget)
                    if not finished:
                        budget.skip(f"{shape}/{variant} rest of the longest-seq search")
                row_max = row_max or (max(fitted) if fitted else None)
            row = {"shape": shape, "variant": variant, "impl": impl, "batch": args.batches[0], "max_seq": row_max}
            if not finished:
                row["max_seq_lower_bound"] = True  # the search was cut by the time budget: at least this long fits
            results["cases"].append(row)
            append_result(args.results, {"what": "train_step", **row}, meta)
            del model, opt
            _free()
            write(results, args.output)
    results["ratios"] = ratios(results["cases"])
    results["markdown"] = markdown(results)
    print(results["markdown"])
    for r in results["ratios"]:
        print(ratio_line(r))
    if budget.skipped:
        print(f"time budget of {args.time_budget_s:g} s spent: skipped {'; '.join(budget.skipped)}", flush=True)
    write(results, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
