#!/usr/bin/env python
"""LoRA fine-tuning benchmark: polyfuse's Llama + PEFT against transformers' Llama (sdpa) + PEFT in one run.

The same LoRA on both (PEFT ``LoraConfig``: rank 16, alpha 32, dropout 0.05 on q/k/v/o/gate/up/down_proj by default;
base weights frozen), random bf16 weights in a real shape (the llama-3-8b shape by default on a GPU), AdamW (fused
on CUDA) over the adapter only. A step is what transformers' Trainer does per batch: forward with labels, backward,
clip grad norm, optimizer step, zero grad. Reports tokens/s and peak memory (``torch.cuda.max_memory_allocated``,
the warm-up step included) per variant, batch and sequence, then one polyfuse/transformers ratio line per (seq,
batch) against the issue's target (>= 1.2x tokens/s at <= 0.8x peak memory). With --output the JSON is rewritten
after every case, so a run killed part-way keeps what it measured. Needs peft (pip install 'polyfuse[lora]').

    python benchmarks/benchmark_lora.py --output lora.json                          # GPU: 8B shape, seq 2048, batch 1,4
    python benchmarks/benchmark_lora.py --gradient_checkpointing --batch 4,8 --output lora_ckpt.json
    python benchmarks/benchmark_lora.py --shape tiny --output /tmp/lora_tiny.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmark_training.py's shapes and step

import torch  # noqa: E402
from benchmark_training import SHAPES, Budget, _free, _ratio, build, run_case  # noqa: E402

from benchmarks.harness.report import append_result, markdown_row, run_meta, write_json  # noqa: E402


PROG = "benchmark_lora.py"
VARIANTS = ("transformers", "polyfuse")
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET = {"tokens_per_s_ratio": 1.2, "peak_mem_ratio": 0.8}  # issue 13: >= 1.2x tokens/s at <= 0.8x memory


def _fail(msg: str):
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _ints(text: str, what: str) -> list:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        _fail(f"{what} must be a comma list of integers, got {text!r}")
    if not values or min(values) < 1:
        _fail(f"{what} must be at least 1")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.error = _fail
    p.add_argument("--shape", default=None, help=f"one of {', '.join(SHAPES)} (default: llama-3-8b on GPU, else tiny)")
    p.add_argument("--seq", default=None, help="comma list of sequence lengths (default 2048; tiny: 64)")
    p.add_argument("--batch", default="1,4", help="comma list of batch sizes (default 1,4)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up step)")
    p.add_argument("--lora_rank", type=int, default=16)
    p.add_argument("--lora_alpha", type=float, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--lora_target_modules", default=",".join(ALL_MODULES), help="comma list (default: all seven)")
    p.add_argument(
        "--gradient_checkpointing", action="store_true", help="checkpoint every decoder layer on both variants"
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of transformers, polyfuse")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu")
    p.add_argument("--polyfuse_ops", default="", help="registry overrides for the polyfuse variant")
    p.add_argument(
        "--time_budget_s", type=float, default=None, help="start no new case once this many seconds have passed"
    )
    p.add_argument("--output", default=None, help="write the results as JSON here (rewritten after every case)")
    p.add_argument(
        "--results",
        default=None,
        help="append each case with the date, device, versions and command to this JSON-lines file, or to lora.jsonl in this folder (benchmarks/results)",
    )
    a = p.parse_args(argv)
    try:
        import peft  # noqa: F401
    except ImportError:
        _fail("needs peft: pip install 'polyfuse[lora]' (or pip install peft)")
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        _fail("--device cuda asked for but no CUDA GPU is available")
    a.shape = a.shape or ("llama-3-8b" if a.device.startswith("cuda") else "tiny")
    if a.shape not in SHAPES:
        _fail(f"unknown --shape {a.shape!r} (choose from {', '.join(SHAPES)})")
    a.seqs = _ints(a.seq or ("64" if a.shape == "tiny" else "2048"), "--seq")
    a.batches = _ints(a.batch, "--batch")
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not a.variants or any(v not in VARIANTS for v in a.variants):
        _fail(f"--variants must be a comma list of {', '.join(VARIANTS)}, got {','.join(a.variants)!r}")
    a.targets = [m.strip() for m in a.lora_target_modules.split(",") if m.strip()]
    if not a.targets or any(m not in ALL_MODULES for m in a.targets):
        _fail(f"--lora_target_modules must be a comma list of {', '.join(ALL_MODULES)}")
    if a.lora_rank < 1 or a.steps < 1:
        _fail("--lora_rank and --steps must be at least 1")
    if not 0 <= a.lora_dropout < 1:
        _fail(f"--lora_dropout must be in [0, 1), got {a.lora_dropout}")
    if a.time_budget_s is not None and a.time_budget_s <= 0:
        _fail("--time_budget_s must be positive")
    a.torch_dtype = getattr(torch, a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"))
    return a


def build_lora(variant: str, args):
    """The variant's base model (benchmark_training.build: random weights, transformers with sdpa, polyfuse with its
    flash attention flag) wrapped by PEFT's LoRA; checkpointing enabled on the base after wrapping."""
    from peft import LoraConfig, get_peft_model

    model, report, impl = build(variant, args.shape, args, max(args.seqs))
    config = LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=args.targets,
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(model, config)
    if args.gradient_checkpointing:
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, report, impl + " + PEFT LoRA"


def make_optimizer(model, device):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")


def ratios(cases) -> list:
    by = {(c["variant"], c["seq"], c["batch"]): c for c in cases if "tokens_per_s" in c}
    out = []
    for (variant, seq, batch), pf in by.items():
        other = by.get(("transformers", seq, batch))
        if variant != "polyfuse" or other is None:
            continue
        r = {"seq": seq, "batch": batch, "tokens_per_s_ratio": _ratio(pf["tokens_per_s"], other["tokens_per_s"]),
             "peak_mem_ratio": _ratio(pf["peak_mem_gib"], other["peak_mem_gib"])}  # fmt: skip
        if r["tokens_per_s_ratio"] is not None and r["peak_mem_ratio"] is not None:
            r["target_met"] = (
                r["tokens_per_s_ratio"] >= TARGET["tokens_per_s_ratio"]
                and r["peak_mem_ratio"] <= TARGET["peak_mem_ratio"]
            )
        out.append(r)
    return out


def ratio_line(shape: str, r) -> str:
    mem = "n/a" if r["peak_mem_ratio"] is None else f"{r['peak_mem_ratio']:.2f}x"
    verdict = {True: "met", False: "not met"}.get(r.get("target_met"), "n/a")
    return (f"ratio {shape} LoRA seq {r['seq']} batch {r['batch']}: polyfuse/transformers tokens/s "
            f"{r['tokens_per_s_ratio']:.2f}x, peak memory {mem} (target >= {TARGET['tokens_per_s_ratio']}x at "
            f"<= {TARGET['peak_mem_ratio']}x: {verdict})")  # fmt: skip


def markdown(results) -> str:
    ckpt = "yes" if results["gradient_checkpointing"] else "no"
    rows = [
        "| shape | variant | batch | seq | grad ckpt | tokens/s | peak GiB | step s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in results["cases"]:
        cells = [results["shape"], c["variant"], c["batch"], c["seq"], ckpt, c.get("tokens_per_s", c.get("error")),
                 c.get("peak_mem_gib"), c.get("step_s")]  # fmt: skip
        rows.append(markdown_row(cells))
    return "\n".join(rows)


def write(results, path) -> None:
    results["ratios"] = ratios(results["cases"])
    results["markdown"] = markdown(results)
    write_json(results, path)  # atomic: a kill mid-write leaves the previous version


def main(argv=None) -> int:
    args = parse_args(argv)
    import peft
    import transformers

    device = torch.device(args.device)
    budget = Budget(args.time_budget_s)
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(args.torch_dtype).replace("torch.", ""), "shape": args.shape, "seqs": args.seqs,
        "batches": args.batches, "steps": args.steps, "gradient_checkpointing": args.gradient_checkpointing,
        "lora": {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
                 "target_modules": args.targets},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "time_budget_s": args.time_budget_s, "skipped": budget.skipped, "cases": [],
    }  # fmt: skip
    meta = run_meta(results["device"]) if args.results else None
    lora = {f"lora_{k}": v for k, v in results["lora"].items()}
    for variant in args.variants:
        grid = [(b, s) for b in args.batches for s in args.seqs]
        if budget.over():
            budget.skipped.extend(f"{variant} batch {b} seq {s}" for b, s in grid)
            continue
        torch.manual_seed(0)
        oom = False
        try:
            model, report, impl = build_lora(variant, args)
        except torch.cuda.OutOfMemoryError:
            oom = True
        if oom:
            results["cases"].append({"variant": variant, "batch": None, "seq": None, "error": "OOM building"})
            _free()
            write(results, args.output)
            continue
        if report:
            print(report, flush=True)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"{variant}: {impl}, {trainable:,} trainable parameters", flush=True)
        opt = make_optimizer(model, device)
        for batch, seq in grid:
            if budget.over():
                budget.skip(f"{variant} batch {batch} seq {seq}")
                continue
            case = {"variant": variant, "impl": impl, "batch": batch, "seq": seq, "trainable_params": trainable,
                    "gradient_checkpointing": args.gradient_checkpointing}  # fmt: skip
            oom = False
            t0 = time.perf_counter()
            try:
                case.update(run_case(model, opt, args, seq, batch, args.steps))
            except torch.cuda.OutOfMemoryError:
                oom = True
            if oom:  # one case out of memory does not stop the sweep
                case["error"] = "OOM"
                _free(opt, model)
            case["wall_s"] = round(time.perf_counter() - t0, 2)
            results["cases"].append(case)
            print(json.dumps(case), flush=True)
            write(results, args.output)
            append_result(args.results, {"what": "lora_step", "shape": args.shape, **case, **lora}, meta)
        del model, opt
        _free()
    write(results, args.output)
    print(results["markdown"])
    for r in results["ratios"]:
        print(ratio_line(args.shape, r))
    if budget.skipped:
        print(f"time budget of {args.time_budget_s:g} s spent: skipped {'; '.join(budget.skipped)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
