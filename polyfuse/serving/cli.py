"""``polyfuse serve``'s flags: run_generation.py's names for the model and the run (--model_name_or_path, --device,
--bf16, --quant, --use_flash_attention, --use_cuda_graphs / --use_hpu_graphs, --bucket_size, --ops), vLLM's for
the server (--host, --port, --max_num_seqs, --max_model_len, --block_size, --max_num_batched_tokens,
--gpu_memory_utilization, --api_key). Every flag takes its dash spelling too (--max-num-seqs)."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:  # size: the server's flags, one declaration each
    p = argparse.ArgumentParser(
        prog="polyfuse serve",
        description="An OpenAI-compatible server (chat and text completions) with continuous batching over a paged "
        "KV cache (docs/serving.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def a(name, *args, group=p, **kw):
        names = ["--" + name] + (["--" + name.replace("_", "-")] if "_" in name else [])
        group.add_argument(*names, *args, **kw)

    g = p.add_argument_group("model")
    a("model_name_or_path", group=g, default=None,
      help="a local folder (config.json + safetensors, or one .gguf) or a Hugging Face Hub id; default: the "
      "built-in SmolLM2-135M-Instruct")  # fmt: skip
    a("gguf_file", group=g, default=None, help="GGUF file inside --model_name_or_path, when it holds several")
    a("tokenizer", group=g, default=None, help="tokenizer folder, .gguf or Hub id, for a checkpoint without one")
    a("token", group=g, default=None, help="Hugging Face token for downloading a Hub id")
    a("trust_remote_code", group=g, action="store_true", help="accepted and ignored: polyfuse runs its own code")
    a(
        "served_model_name",
        group=g,
        default=None,
        help="the name clients pass as 'model' (default: --model_name_or_path as given, or the built-in model's name)",
    )
    a("device", "-d", group=g, default="auto", choices=["auto", "cpu", "cuda", "hpu"],
      help="auto: hpu, then cuda, then cpu")  # fmt: skip
    a("bf16", group=g, action="store_true", help="run in bfloat16 (default float32)")
    a(
        "quant",
        group=g,
        default=None,
        choices=["fp8", "fp8_block", "int8", "int4", "gguf", "none"],
        help="quantize a float checkpoint's projections at load (as run_generation.py --quant)",
    )
    a("quant_lm_head", group=g, action="store_true", help="quantize the LM head too")
    a("ops", group=g, default="", help="per-op overrides, e.g. '-paged_attention' (as run_generation.py --ops)")
    a("use_flash_attention", group=g, action="store_true",
      help="accepted as run_generation.py takes it; the paged attention kernels (Triton on NVIDIA, FusedSDPA over "
      "the gathered blocks on Gaudi) run without it, --ops -paged_attention runs the native gather instead")  # fmt: skip
    a(
        "use_cuda_graphs",
        group=g,
        action="store_true",
        help="NVIDIA: decode steps replay a CUDA graph captured per batch-size bucket (at startup)",
    )
    a("use_hpu_graphs", group=g, action="store_true", help="Gaudi: HPU graphs, one per static-shape bucket")
    a("limit_hpu_graphs", group=g, action="store_true", help="Gaudi: no HPU graphs for prefill steps")
    a(
        "bucket_size",
        group=g,
        type=int,
        default=128,
        help="Gaudi: prefill chunks and block tables padded to multiples of this many tokens (static shapes)",
    )
    a("print_backends", group=g, action="store_true", help="print which implementation each op got and why")

    g = p.add_argument_group("scheduling and KV cache")
    a("max_num_seqs", group=g, type=int, default=64, help="sequences in the running batch at most")
    a(
        "max_model_len",
        group=g,
        type=int,
        default=None,
        help="prompt + completion tokens per sequence at most (default: the model's positions, capped by the cache)",
    )
    a(
        "max_num_batched_tokens",
        group=g,
        type=int,
        default=2048,
        help="tokens per step (decodes first, then prefill chunks: a longer prompt is prefilled over several steps)",
    )
    a("block_size", group=g, type=int, default=16, help="tokens per KV-cache block")
    a("num_kv_blocks", group=g, type=int, default=None, help="KV-cache blocks (default: from the memory flags)")
    a(
        "gpu_memory_utilization",
        group=g,
        type=float,
        default=0.9,
        help="NVIDIA / Gaudi: share of the device memory the weights, activations and KV cache may take",
    )
    a(
        "kv_cache_memory_gb",
        group=g,
        type=float,
        default=2.0,
        help="CPU: memory for the KV cache (at most what --max_num_seqs sequences of --max_model_len need)",
    )
    a(
        "enable_prefix_caching",
        group=g,
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the KV blocks of equal prompt prefixes between requests",
    )
    a(
        "max_waiting",
        group=g,
        type=int,
        default=256,
        help="waiting requests at most; beyond it a request is answered 429",
    )
    a("seed", group=g, type=int, default=0, help="seed of the sampling of requests without a seed of their own")
    a(
        "num_scheduler_steps",
        group=g,
        type=int,
        default=1,
        metavar="N",
        help="multi-step decoding: a batch of decodes runs this many steps back to back on the device, one host "
        "sync for them all, 1..64 (new requests wait at most that long; not with speculative decoding or tensor "
        "parallelism)",
    )

    g = p.add_argument_group("speculative decoding (run_generation.py's names; docs/serving.md)")
    a("speculative_method", group=g, default=None, choices=["prompt_lookup", "ngram"],
      help="prompt_lookup (vLLM's name: ngram): draft each decoding sequence's next tokens from its prompt and "
      "output so far, verify them in the batch's step (draft models and EAGLE-3 heads: generation only)")  # fmt: skip
    a("prompt_lookup_num_tokens", group=g, type=int, default=None, metavar="K",
      help="prompt lookup: tokens drafted per sequence and step, 1..32 (10 when only --speculative_method is "
      "given); implies the method")  # fmt: skip
    a("num_speculative_tokens", group=g, type=int, default=None, metavar="K",
      help="the same k under its method-neutral name")  # fmt: skip
    a("max_matching_ngram_size", group=g, type=int, default=None, metavar="N",
      help="prompt lookup: the longest n-gram matched (2 when not given)")  # fmt: skip

    g = p.add_argument_group("server")
    a("host", group=g, default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    a("port", group=g, type=int, default=8000, help="port to listen on (0: a free one, printed at startup)")
    a(
        "api_key",
        group=g,
        default=None,
        help="require 'Authorization: Bearer <key>' on every route but /health (default: POLYFUSE_API_KEY if set)",
    )
    a(
        "shutdown_timeout",
        group=g,
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may take to finish before they are cancelled",
    )
    a(
        "log_level",
        group=g,
        default="warning",
        choices=["debug", "info", "warning", "error", "critical"],
        help="level of polyfuse's, transformers' and uvicorn's log messages",
    )
    return p


def speculative_setting_of(args):
    """The run's SpeculativeSetting (prompt lookup's k and n-gram size), or None; bad values raise UsageError."""
    from polyfuse.cli.generate import UsageError
    from polyfuse.generation.options import GenerationOptions
    from polyfuse.generation.speculative.settings import speculative_setting

    method = "prompt_lookup" if args.speculative_method == "ngram" else args.speculative_method
    given = args.num_speculative_tokens is not None or args.max_matching_ngram_size is not None
    if method is None and args.prompt_lookup_num_tokens is None and given:
        raise UsageError(
            "--num_speculative_tokens / --max_matching_ngram_size need --speculative_method prompt_lookup"
        )
    try:
        options = GenerationOptions(
            prompt_lookup_num_tokens=args.prompt_lookup_num_tokens, max_matching_ngram_size=args.max_matching_ngram_size,
            speculative_method=method, num_speculative_tokens=args.num_speculative_tokens,
        )  # fmt: skip
        return speculative_setting(options)
    except ValueError as e:
        raise UsageError("--" + str(e)) from None


def validate(args) -> None:
    from polyfuse.cli.generate import UsageError

    for name, low in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("block_size", 1), ("max_waiting", 1),
                      ("bucket_size", 1)):  # fmt: skip
        if getattr(args, name) < low:
            raise UsageError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    for name in ("max_model_len", "num_kv_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 2:
            raise UsageError(f"--{name} must be >= 2, got {getattr(args, name)}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if not args.kv_cache_memory_gb > 0:
        raise UsageError(f"--kv_cache_memory_gb must be > 0, got {args.kv_cache_memory_gb}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise UsageError(f"--shutdown_timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key == "":
        raise UsageError("--api_key is empty")
    if not 1 <= args.num_scheduler_steps <= 64:
        raise UsageError(f"--num_scheduler_steps must be in 1..64, got {args.num_scheduler_steps}")
    if speculative_setting_of(args) is not None and args.num_scheduler_steps > 1:
        raise UsageError("--num_scheduler_steps > 1 and speculative decoding: give one of them")
