#!/usr/bin/env python
"""FSDP2 training benchmark: PolyfuseTrainer (polyfuse's Llama) and transformers' Trainer (transformers' Llama,
sdpa) in one torchrun run, both with the same FSDP2 settings (accelerate's plugin, ``fully_shard`` per decoder
layer), random weights in a real shape, the same data, optimizer and gradient checkpointing.

    torchrun --nproc-per-node 2 benchmarks/benchmark_fsdp.py --shape llama-3-8b --seq 4096 --output fsdp.json
    torchrun --nproc-per-node 2 benchmarks/benchmark_fsdp.py --shape tiny          # CPU smoke test (gloo)

Each rank draws the model's random weights (on its GPU, then moved to host memory: bf16, 16 GB for the 8B shape; the
same seed everywhere), and the Trainer's FSDP2 preparation moves only the rank's shard of each layer back to its
GPU, so no GPU holds the whole model while it trains (the build's GPU copy is freed before the first step, and the
peaks are reset after the warm-up steps). Weights, gradients and AdamW state are in the weights' dtype (no fp32 master copy: ``bf16`` is off,
as in benchmarks/benchmark_training.py); the optimizer is torch's fused AdamW. After ``--warmup`` steps the next
``--steps`` are timed: tokens/s per GPU (each rank's batch x sequence per step over the slowest rank's time) and the
per-GPU peak of ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (the largest over the ranks). Rank 0
prints one line per case, then the polyfuse/transformers ratios and issue 13's targets; with ``--output`` it
rewrites the JSON after every case.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time


os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from benchmark_training import SHAPES  # noqa: E402

from benchmarks.harness.report import append_result, run_meta, write_json  # noqa: E402
from polyfuse.distributed.launch import distributed_entry  # noqa: E402


PROG = "benchmark_fsdp.py"
VARIANTS = ("transformers", "polyfuse")
LAYER_CLASS = {"transformers": "LlamaDecoderLayer", "polyfuse": "DecoderLayer"}
TARGET_PEAK_GIB, TARGET_RATIO = 36.0, 1.2  # issue 13: 8B, seq 4096, FSDP2 on 2 x H200


def _fail(msg: str):
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.error = _fail
    p.add_argument(
        "--shape", default=None, help=f"one of {', '.join(SHAPES)} (default: llama-3-8b on GPU, tiny on CPU)"
    )
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 4096; tiny: 64)")
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU per step (default 1)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--variants", default="transformers,polyfuse", help="comma list of transformers, polyfuse")
    p.add_argument(
        "--no_gradient_checkpointing", action="store_true", help="train without gradient checkpointing (default: on)"
    )
    p.add_argument("--polyfuse_ops", default="", help="registry overrides for the polyfuse variant")
    p.add_argument("--output", default=None, help="results JSON (rank 0), rewritten after every case")
    p.add_argument("--results", default=None, help="rank 0 appends each case, with the date, device, versions and "
                   "command, to this JSON-lines file or to fsdp.jsonl in this folder (benchmarks/results)")  # fmt: skip
    a = p.parse_args(argv)
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    a.shape = a.shape or ("llama-3-8b" if a.device == "cuda" else "tiny")
    if a.shape not in SHAPES:
        _fail(f"unknown --shape {a.shape!r} (choose from {', '.join(SHAPES)})")
    a.seq = a.seq or (64 if a.shape == "tiny" else 4096)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in a.variants:
        if v not in VARIANTS:
            _fail(f"unknown variant {v!r} ({', '.join(VARIANTS)})")
    if min(a.seq, a.batch, a.steps) < 1 or a.warmup < 1:
        _fail("--seq, --batch, --steps and --warmup must be at least 1")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        _fail("FSDP needs several processes: run it with torchrun --nproc-per-node N (N >= 2)")
    a.dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    return a


def fsdp_arguments(variant: str) -> dict:
    """The FSDP2 settings, the same for both Trainers (only the layer class's name differs)."""
    config = {"fsdp_version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT",
              "transformer_layer_cls_to_wrap": [LAYER_CLASS[variant]]}  # fmt: skip
    return {"fsdp": "full_shard auto_wrap", "fsdp_config": config}


def build(variant: str, args):
    """The model in host memory, the same on every rank (seed 0). Drawing the 8B shape's random weights on the CPU
    did not finish in a 170 s call on 2 x H200 (torchrun gives each process one OpenMP thread), so on a GPU
    the weights are drawn there (the device's RNG, seconds) and then moved to host memory; the GPU's cache is
    emptied and its peak counters are reset after the warm-up steps, so this does not enter the measured peak. The
    Trainer's FSDP2 preparation then moves only the rank's shard of each layer to its GPU."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max(args.seq, 4096), attn_implementation="sdpa")
    if variant == "polyfuse":
        from polyfuse.models.llama import LlamaForCausalLM

        model = LlamaForCausalLM.from_config(cfg, dtype=args.dtype, device=args.device, training=True, seed=0)
    else:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        old = torch.get_default_dtype()
        torch.set_default_dtype(args.dtype)
        try:
            with torch.device(args.device):
                model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(old)
    if args.device == "cuda":
        model = model.to("cpu")
        gc.collect()
        torch.cuda.empty_cache()
    return model


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_timer(args):
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        """After the warm-up steps: reset the peak counters and start the clock; at the end, stop it."""

        t0 = t1 = None

        def on_step_end(self, targs, state, control, **kw):
            if state.global_step == args.warmup:
                _sync(args.device)
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                self.t0 = time.perf_counter()

        def on_train_end(self, targs, state, control, **kw):
            _sync(args.device)
            self.t1 = time.perf_counter()

    return Timer()


def trainer_for(variant: str, model, args, out: str, data):
    from transformers import Trainer, TrainingArguments

    from polyfuse.training import PolyfuseTrainer, PolyfuseTrainingArguments
    from polyfuse.training.fsdp import enable_on_cpu

    common = dict(
        output_dir=out, max_steps=args.warmup + args.steps, per_device_train_batch_size=args.batch,
        learning_rate=1e-5, max_grad_norm=1.0, optim="adamw_torch_fused", bf16=False, seed=0, save_strategy="no",
        report_to="none", logging_steps=10**6, disable_tqdm=True, dataloader_drop_last=True,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, use_cpu=args.device == "cpu",
        **fsdp_arguments(variant),
    )  # fmt: skip
    if variant == "polyfuse":
        targs = PolyfuseTrainingArguments(**common, use_flash_attention=True, polyfuse_ops=args.polyfuse_ops)
        return PolyfuseTrainer(model=model, args=targs, train_dataset=data)

    class HFTrainer(Trainer):
        """transformers' Trainer as is; on the CPU (the smoke test) with FSDP2 switched on as PolyfuseTrainer does
        (accelerate enables its FSDP plugin on accelerators only; a no-op on a GPU)."""

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            enable_on_cpu(self)

    return HFTrainer(model=model, args=TrainingArguments(**common), train_dataset=data)


def run_case(variant: str, args, world: int) -> dict:
    import torch.distributed as dist

    rows = args.batch * world * (args.warmup + args.steps)
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape]["vocab_size"]
    ids = torch.randint(0, vocab, (rows, args.seq), generator=g)
    data = [{"input_ids": r, "labels": r} for r in ids]
    before = torch.cuda.memory_allocated() / 2**30 if args.device == "cuda" else None  # left by an earlier case
    t_build = time.perf_counter()
    model = build(variant, args)
    build_s = time.perf_counter() - t_build
    timer = make_timer(args)
    error = None
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_for(variant, model, args, out, data)
        trainer.add_callback(timer)
        try:
            trainer.train()
        except torch.cuda.OutOfMemoryError:
            error = "OOM"
        fsdp = bool(getattr(trainer, "is_fsdp_enabled", False)) and trainer.accelerator.is_fsdp2
    mine = {
        "seconds": None if error else timer.t1 - timer.t0,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if args.device == "cuda" else None,
        "error": error,
    }
    del trainer, model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    errors = sorted({r["error"] for r in everyone if r["error"]})
    case = {"variant": variant, "shape": args.shape, "seq": args.seq, "batch_per_gpu": args.batch, "world": world,
            "gradient_checkpointing": not args.no_gradient_checkpointing, "fsdp2": fsdp,
            "build_s": round(build_s, 1), "allocated_before_gib": None if before is None else round(before, 2)}  # fmt: skip
    if errors:
        case["error"] = ", ".join(errors)
        return case
    slowest = max(r["seconds"] for r in everyone)
    case["tokens_per_s_per_gpu"] = round(args.batch * args.seq * args.steps / slowest, 1)
    case["step_s"] = round(slowest / args.steps, 4)
    if args.device == "cuda":
        case["peak_allocated_gib"] = round(max(r["peak_allocated_gib"] for r in everyone), 2)
        case["peak_reserved_gib"] = round(max(r["peak_reserved_gib"] for r in everyone), 2)
    return case


def summary(cases: list) -> dict:
    by = {c["variant"]: c for c in cases if "tokens_per_s_per_gpu" in c}
    out = {}
    pf, hf = by.get("polyfuse"), by.get("transformers")
    if pf and hf:
        out["tokens_per_s_ratio"] = round(pf["tokens_per_s_per_gpu"] / hf["tokens_per_s_per_gpu"], 3)
        if pf.get("peak_allocated_gib") and hf.get("peak_allocated_gib"):
            out["peak_allocated_ratio"] = round(pf["peak_allocated_gib"] / hf["peak_allocated_gib"], 3)
    if pf and pf.get("peak_allocated_gib") is not None:
        out["peak_target_met"] = pf["peak_allocated_gib"] <= TARGET_PEAK_GIB
    if "tokens_per_s_ratio" in out:
        out["speed_target_met"] = out["tokens_per_s_ratio"] >= TARGET_RATIO
    return out


def case_line(c: dict) -> str:
    if "error" in c:
        return f"{c['variant']:12s} {c['shape']} seq {c['seq']} batch {c['batch_per_gpu']}/GPU: {c['error']}"
    mem = ""
    if c.get("peak_allocated_gib") is not None:
        mem = f", peak {c['peak_allocated_gib']:.2f} GiB allocated / {c['peak_reserved_gib']:.2f} GiB reserved per GPU"
    return (f"{c['variant']:12s} {c['shape']} seq {c['seq']} batch {c['batch_per_gpu']}/GPU x {c['world']}: "
            f"{c['tokens_per_s_per_gpu']} tokens/s per GPU ({c['step_s']} s/step){mem}, FSDP2 {c['fsdp2']}")  # fmt: skip


@distributed_entry(tensor_parallel=False)  # rank 0 prints; every rank exits promptly on an error
def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "world": world,
               "dtype": str(args.dtype)[6:], "steps": args.steps, "warmup": args.warmup,
               "fsdp": fsdp_arguments("polyfuse"), "torch": torch.__version__, "cases": []}  # fmt: skip
    meta = run_meta(f"{world} x {results['device']}") if args.results else None
    for variant in args.variants:
        case = run_case(variant, args, world)
        results["cases"].append(case)
        results["summary"] = summary(results["cases"])
        if dist.get_rank() == 0:
            print(case_line(case), flush=True)
            write_json(results, args.output)
            append_result(args.results, {"what": "fsdp_step", **case}, meta)
    s = results["summary"]
    if "tokens_per_s_ratio" in s:
        mem = f", peak memory {s['peak_allocated_ratio']:.2f}x" if "peak_allocated_ratio" in s else ""
        print(f"ratio polyfuse/transformers: tokens/s per GPU {s['tokens_per_s_ratio']:.2f}x{mem}")
    if args.shape == "llama-3-8b" and args.seq == 4096 and args.device == "cuda":
        print(f"targets (issue 13): polyfuse peak <= {TARGET_PEAK_GIB} GiB per GPU: "
              f"{'met' if s.get('peak_target_met') else 'not met'}; tokens/s >= {TARGET_RATIO}x transformers: "
              f"{'met' if s.get('speed_target_met') else 'not met'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
