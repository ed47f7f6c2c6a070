"""``polyfuse-generate`` / examples/run_generation.py: load, warm up, time, print outputs and a Stats block."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch

from polyfuse.cli.args import FLAG_NAMES, build_parser


DEFAULT_PROMPT = "DeepSpeed is a machine learning framework"
logger = logging.getLogger("polyfuse")


class UsageError(Exception):
    """Bad input the user can fix; printed as one line, exit code 2."""


def pick_device(name: str) -> torch.device:
    from polyfuse.core.platform import default_device_type, hpu_available

    if name == "auto":
        return torch.device(default_device_type())
    if name == "hpu" and not hpu_available():
        raise UsageError("--device hpu: no Gaudi found (habana_frameworks is not installed or sees no HPU)")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible to torch")
    return torch.device(name)


def validate(args) -> None:
    for name in ("batch_size", "max_new_tokens", "n_iterations"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        raise UsageError(f"--top_k must be >= 0, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1], got {args.top_p}")


def load(args, device, flags):
    from polyfuse.engine.tokenizer import load_tokenizer
    from polyfuse.models import AutoModelForCausalLM
    from polyfuse.models.builtin import builtin_model

    path, gguf = args.model_name_or_path, args.gguf_file
    if path is None and gguf is None:
        path, gguf = builtin_model()
    elif path is None:
        path = os.path.dirname(os.path.abspath(gguf))
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        path, gguf_file=gguf, dtype=dtype, device=device, flags=flags, overrides=args.ops
    )
    model.eval()
    try:
        tokenizer = load_tokenizer(path, gguf)
    except Exception as e:
        raise UsageError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {e})") from None
    return model, tokenizer


def encode(args, tokenizer, device):
    prompts = args.prompt or [DEFAULT_PROMPT]
    prompts = [prompts[i % len(prompts)] for i in range(args.batch_size)]
    if args.use_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("--use_chat_template: this tokenizer has no chat template")
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    kw = {"return_tensors": "pt", "add_special_tokens": not args.use_chat_template}
    if args.max_input_tokens > 0:
        kw.update(padding="max_length", max_length=args.max_input_tokens, truncation=True)
    else:
        kw.update(padding=True)
    enc = tokenizer(prompts, **kw)
    return prompts, enc.input_ids.to(device), enc.attention_mask.to(device)


def run(args) -> dict:
    from polyfuse.core.flags import check_flags

    validate(args)
    device = pick_device(args.device)
    if args.flash_attention_fast_softmax is None:
        # optimum-habana's intent: fast softmax by default with Gaudi flash attention, an explicit value wins.
        args.flash_attention_fast_softmax = bool(args.use_flash_attention and device.type == "hpu")
    flags = {name: getattr(args, name) for name in FLAG_NAMES}
    flags, warnings = check_flags(device.type, flags)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    torch.manual_seed(args.seed)
    model, tokenizer = load(args, device, flags)
    if args.print_backends:
        print(model.kernels.report())
    runtime = model.runtime
    gen = torch.Generator(device=device if device.type != "hpu" else "cpu").manual_seed(args.seed)

    def one_run(timings=None):
        t0 = time.perf_counter()
        prompts, ids, mask = encode(args, tokenizer, device)
        out = model.generate(
            ids,
            mask,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=gen,
            ignore_eos=args.ignore_eos,
            bucket_size=args.bucket_size,
            use_cache=args.use_kv_cache,
            timings=timings,
        )
        return prompts, ids, out, time.perf_counter() - t0

    t0 = time.perf_counter()
    for i in range(args.warmup):
        print(f"Warming up iteration {i + 1}/{args.warmup}", flush=True)
        one_run()
    runtime.synchronize()
    compile_s = time.perf_counter() - t0
    runtime.reset_peak_memory()

    firsts, rests, e2es, new_tokens = [], [], [], 0
    t0 = time.perf_counter()
    for i in range(args.n_iterations):
        timings = {}
        prompts, ids, out, e2e = one_run(timings)
        new_tokens += timings["new_tokens"] * args.batch_size
        firsts.append(timings["first_token_s"])
        rests.append(timings["rest_s"] / max(timings["new_tokens"] - 1, 1))
        e2es.append(e2e)
        print(
            f"Iteration {i + 1}/{args.n_iterations}: first token {firsts[-1] * 1e3:.2f} ms, "
            f"rest {rests[-1] * 1e3:.2f} ms/token, end to end {e2e * 1e3:.2f} ms",
            flush=True,
        )
    duration = time.perf_counter() - t0
    texts = tokenizer.batch_decode(out, skip_special_tokens=True)
    mem = runtime.memory_stats()
    result = {
        "throughput": new_tokens / duration,
        "avg_first_token_latency": 1e3 * sum(firsts) / len(firsts),
        "avg_rest_token_latency": 1e3 * sum(rests) / len(rests),
        "avg_e2e_latency": 1e3 * sum(e2es) / len(e2es),
        "graph_compilation_duration": compile_s,
        "memory": mem,
        "input": prompts,
        "output": texts,
        "backends": model.kernels.as_dict(),
        "device": device.type,
    }
    print_report(result, args)
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(result, f, indent=2)
    return result


def print_report(r: dict, args) -> None:
    print("\nInput/outputs:")
    for i, (inp, out) in enumerate(zip(r["input"], r["output"])):
        print(f"input {i + 1}: {(inp,)}")
        print(f"output {i + 1}.1: {(out,)}\n")
    lines = [
        "Input tokens",
        f"Throughput (including tokenization) = {r['throughput']} tokens/second",
        f"Average first token latency         = {r['avg_first_token_latency']} ms",
        f"Average rest token latency          = {r['avg_rest_token_latency']} ms",
        f"Average end to end latency          = {r['avg_e2e_latency']} ms",
    ]
    for k, v in r["memory"].items():
        if v is not None:
            lines.append("{:35} = {} GB".format(k[:-5].replace("_", " ").capitalize(), v))
    lines.append(f"Graph compilation duration          = {r['graph_compilation_duration']} seconds")
    sep = "-" * max(len(s) for s in lines)
    print("Stats:\n" + sep + "\n" + "\n".join(lines) + "\n" + sep)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = build_parser().parse_args(argv)
    from polyfuse.core.errors import CheckpointError, one_line

    try:
        run(args)
    except (UsageError, CheckpointError, ValueError, FileNotFoundError) as e:
        print("error: " + one_line(e), file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError:
        print("error: out of GPU memory; lower --batch_size or --max_new_tokens", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
