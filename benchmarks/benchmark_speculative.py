#!/usr/bin/env python
"""Speculative decoding at batch 1 (docs/speculative.md): what a verify step costs and what it buys.

    # one GPU, the 8B shape in bf16 with random weights, CUDA graphs (parts verify, replay, draft)
    python benchmarks/benchmark_speculative.py --parts verify,replay,draft --results benchmarks/results
    # prompt lookup on the built-in model's real weights (CPU or GPU)
    python benchmarks/benchmark_speculative.py --parts lookup --results benchmarks/results
    # CPU smoke at a tiny shape
    python benchmarks/benchmark_speculative.py --shape tiny8 --draft_shape tiny --ks 2 --taus 2 --context 16 --new_tokens 8

* verify: one cached step over k + 1 positions (the pending token and k drafts; with EAGLE-3's hidden states too)
  against one decode step, at a KV length of --context, through the engine's decode step (CUDA graphs on NVIDIA).
* replay: generate() with EAGLE-3 heads of the published Llama-3-8B layout (random weights, draft vocabulary 32000)
  under a forced acceptance whose mean accepted length is --tau (EAGLE-3's published ~6 at k = 8 on MT-bench): every
  step runs as a real one (heads, verify, commits), so tokens per second against plain greedy decoding is the
  effective speedup at that acceptance. The random weights cannot accept on their own.
* draft: the same replay with a draft model of --draft_shape (Llama-3.2-1B) drafting for the target.
* lookup: prompt lookup on the built-in model's real weights on input-grounded prompts (a rewrite and a summary of a
  passage, a code edit): its real acceptance and the wall-clock speedup; the output is checked equal to plain
  greedy decoding.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.harness.measure import time_median  # noqa: E402
from benchmarks.harness.report import RowSink  # noqa: E402
from benchmarks.harness.shapes import config_for  # noqa: E402
from benchmarks.harness.speculative import random_heads, schedule, timed_generate  # noqa: E402
from polyfuse.generation.cached_step import CachedStep  # noqa: E402
from polyfuse.generation.speculative.accept import ForcedAcceptance  # noqa: E402
from polyfuse.models import AutoModelForCausalLM  # noqa: E402


generation = importlib.import_module("polyfuse.generation.generate")
PASSAGE = (
    "The committee met on Tuesday to review the budget. It approved the new library wing, postponed the road "
    "repairs until spring, and asked the treasurer to publish the audited figures before the next meeting, "
    "noting that the library wing would open in the autumn if the contractor kept to the agreed schedule."
)
TASKS = {
    "rewrite": f"Rewrite this passage in the past perfect tense, keeping every detail:\n\n{PASSAGE}",
    "summarise": f"Summarise this passage, keeping its names and figures:\n\n{PASSAGE}",
    "code_edit": "Rename the variable total to subtotal and return it, changing nothing else:\n\ndef add(xs):\n"
                 "    total = 0\n    for x in xs:\n        total += x\n    return total\n",
}  # fmt: skip


def log(row: dict, out: RowSink) -> None:
    print(json.dumps(row), flush=True)
    out.write(row)


def build(shape: str, device, dtype, flags: dict, seed: int = 0):
    return AutoModelForCausalLM.from_config(config_for(shape), dtype=dtype, device=device, flags=flags, seed=seed)


def verify_ms(model, context: int, width: int, layers=None) -> float:
    """Median ms of one cached step over ``width`` positions after ``context`` cached ones (the engine's decode
    step: graphed under use_cuda_graphs)."""
    device = model.device
    step = CachedStep(model)
    step.reserve(1, context + 64)
    key_mask = torch.ones(1, model.cache.max_len, dtype=torch.bool, device=device)
    ids = torch.randint(10, model.config.vocab_size, (1, width), device=device)
    pos = torch.arange(context, context + width, device=device)[None]
    cache_position = pos[0].clone()
    keep = None if width == 1 else width
    return 1e3 * time_median(lambda: step(ids, pos, cache_position, key_mask, model.cache.max_len, keep, layers),
                             reps=50, warmup=3)  # fmt: skip


def part_verify(args, target, out) -> None:
    heads = random_heads(target, seed=1)
    layers = heads.capture_layers(target.config.num_hidden_layers)
    decode = verify_ms(target, args.context, 1)
    for k in args.ks:
        for eagle in (False, True):
            ms = verify_ms(target, args.context, k + 1, layers if eagle else None)
            log(dict(what="spec_verify", shape=args.shape, dtype=args.dtype, k=k, context=args.context,
                     hidden_states=eagle, verify_ms=round(ms, 4), decode_ms=round(decode, 4),
                     cost=round(ms / decode, 3)), out)  # fmt: skip


class CaptureFailures(logging.Handler):
    """Counts the runtime's "CUDA graph capture failed" warnings: a replay that fell back to eager steps says so."""

    count = 0

    def emit(self, record) -> None:
        self.count += "capture failed" in record.getMessage()


def replay(args, target, method: str, spec: dict, k: int, tau: float, plain: dict, ids, out) -> None:
    real = generation.speculative_decode
    generation.speculative_decode = lambda d, p: real(d, p, ForcedAcceptance(schedule(tau, k)))
    failed = CaptureFailures()
    logging.getLogger("polyfuse").addHandler(failed)
    try:
        got = timed_generate(target, ids, args.reps, **spec, **generate_kw(args))
    finally:
        generation.speculative_decode = real
        logging.getLogger("polyfuse").removeHandler(failed)
    stats = got["stats"]
    log(dict(what="spec_replay", shape=args.shape, dtype=args.dtype, method=method, k=k, forced_tau=tau,
             draft_shape=args.draft_shape if method == "draft" else None, prompt_len=ids.shape[1],
             new_tokens=args.new_tokens, tokens_per_step=round(stats.tokens_per_step, 3),
             ms_per_token=round(got["ms_per_token"], 4), plain_ms_per_token=round(plain["ms_per_token"], 4),
             speedup=round(plain["ms_per_token"] / got["ms_per_token"], 3),
             **({"graphs": "failed"} if failed.count else {})), out)  # fmt: skip


def generate_kw(args) -> dict:
    return dict(max_new_tokens=args.new_tokens, ignore_eos=True, bucket_size=128)


def part_replay(args, target, out, draft=None) -> None:
    ids = torch.randint(10, target.config.vocab_size, (1, args.context), device=target.device)
    plain = timed_generate(target, ids, args.reps, **generate_kw(args))
    for k, tau in zip(args.ks, args.taus):
        if draft is None:
            spec = dict(speculative_model=random_heads(target, seed=1), num_speculative_tokens=k)
            replay(args, target, "eagle3", spec, k, tau, plain, ids, out)
        else:
            replay(args, target, "draft", dict(assistant_model=draft, num_assistant_tokens=k), k, tau, plain, ids, out)


def part_lookup(args, out) -> None:
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models.builtin import builtin_model

    folder, name = builtin_model()
    device = torch.device(args.device)
    flags = {"use_flash_attention": True, "use_cuda_graphs": True} if device.type == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, device=device, flags=flags).eval()
    tok = load_tokenizer(folder, name)
    for task, text in TASKS.items():
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        ids = tok(chat, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
        kw = dict(max_new_tokens=args.lookup_tokens, eos_token_id=tok.eos_token_id)
        plain = timed_generate(model, ids, args.reps, **kw)
        for k in args.lookup_ks:
            got = timed_generate(model, ids, args.reps, prompt_lookup_num_tokens=k, **kw)
            if not torch.equal(got["out"], plain["out"]):
                raise SystemExit(f"prompt lookup changed the greedy output on {task}")
            s = got["stats"]
            log(dict(what="spec_lookup", model="SmolLM2-135M-Instruct", dtype="float32", task=task, k=k,
                     prompt_len=ids.shape[1], new_tokens=got["new_tokens"], acceptance=round(s.acceptance_rate, 3),
                     tokens_per_step=round(s.tokens_per_step, 3), e2e_s=round(got["e2e_s"], 4),
                     plain_e2e_s=round(plain["e2e_s"], 4), speedup=round(plain["e2e_s"] / got["e2e_s"], 3),
                     decode_speedup=round(plain["ms_per_token"] / got["ms_per_token"], 3)), out)  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="verify,replay,draft", help="comma list of verify, replay, draft, lookup")
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--draft_shape", default="llama3.2-1b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on the CPU")
    p.add_argument("--ks", default="4,8", help="drafted tokens per step")
    p.add_argument("--taus", default="4,6", help="forced mean accepted length (drafts + 1) for each of --ks")
    p.add_argument("--context", type=int, default=512, help="prompt tokens (the verify step's KV length)")
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--lookup_ks", default="4,10", help="prompt lookup: drafted tokens per step")
    p.add_argument("--lookup_tokens", type=int, default=128, help="prompt lookup: new tokens at most")
    p.add_argument("--flags", default="use_flash_attention,use_cuda_graphs", help="polyfuse run flags on cuda")
    p.add_argument("--output", default=None, help="append JSON lines here")
    p.add_argument("--results", default=None, help="append the figure rows with date, device, versions and command "
                   "to this JSON-lines file, or to speculative.jsonl in this folder")  # fmt: skip
    args = p.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",")]
    args.taus = [float(t) for t in args.taus.split(",")]
    args.lookup_ks = [int(k) for k in args.lookup_ks.split(",")]
    if len(args.taus) != len(args.ks):
        p.error("--taus needs one value per --ks")
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    flags = {f: True for f in args.flags.split(",") if f} if device.type == "cuda" else {}
    parts = set(args.parts.split(","))
    out = RowSink(args.output, args.results, torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    torch.manual_seed(0)
    with torch.inference_mode():
        if parts & {"verify", "replay", "draft"}:
            target = build(args.shape, device, dtype, flags).eval()
            if "verify" in parts:
                part_verify(args, target, out)
            if "replay" in parts:
                part_replay(args, target, out)
            if "draft" in parts:
                part_replay(args, target, out, draft=build(args.draft_shape, device, dtype, flags, seed=1).eval())
        if "lookup" in parts:
            part_lookup(args, out)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
