"""Before benchmark_generation.py builds anything: the defaults for the device it runs on, and whether the shapes and
batch sizes asked for fit in its memory (an estimate of weights, KV caches, the peers' copies and the prefill's
activations against what the device has free), so that a run that cannot fit is one error line instead of an
out-of-memory kill minutes in (the GPU defaults on a CPU reached 23 GB of RSS)."""

from __future__ import annotations

import os

import torch


# The GPU-sized defaults (--shapes llama3-8b,... at batch 64) and the CPU's: the tiny shape, a few tokens.
GPU_DEFAULTS = dict(shapes="llama3-8b,llama2-7b,llama2-13b", batch_sizes="1,16,64", prompt_len=128, new_tokens=256,
                    peers="eager,static_compile", peer_shapes="llama3-8b", peer_batch_sizes="1,16,64", prefill="2048")  # fmt: skip
CPU_DEFAULTS = dict(shapes="tiny", batch_sizes="1,2", prompt_len=32, new_tokens=16, peers="eager", peer_shapes="tiny",
                    peer_batch_sizes="1", prefill="64")  # fmt: skip
# Besides the estimate: the runtime, allocator slack and what this process already holds.
SLACK, FIXED_BYTES = 1.2, 1 << 30
GB = 1e9


def fill_defaults(args, device) -> str | None:
    """Give every option left unset (None) the device's default; on the CPU, a one-line warning when the shapes were
    left to the defaults (the GPU defaults would need tens of GB there)."""
    defaults = CPU_DEFAULTS if device.type == "cpu" else GPU_DEFAULTS
    shapes_given = args.shapes is not None
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if device.type == "cpu" and not shapes_given:
        return (f"warning: on the CPU the default run is --shapes {args.shapes} --batch_sizes {args.batch_sizes} "
                f"--new_tokens {args.new_tokens}: the GPU defaults ({GPU_DEFAULTS['shapes']}, batch up to 64) do not "
                "fit a CPU's memory or time; give --shapes to run others")  # fmt: skip
    return None


def _proj_params(cfg) -> int:
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    return layers * (attn + 3 * h * cfg.intermediate_size)


def _weight_bytes(cfg, dtype_bytes: int, quant: str | None) -> int:
    """The weights as built: projections in the --quant format (about), embedding and head in the run's dtype."""
    from polyfuse.ops.quant_formats import GGUF_BYTES, GGUF_WEIGHTS

    per_weight = {"fp8": 1.0, "fp8_block": 1.0, "int8": 1.0, "int4": 0.56}
    if quant in GGUF_BYTES:
        per_weight[quant] = GGUF_BYTES[quant] / GGUF_WEIGHTS[quant]
    proj = _proj_params(cfg) * per_weight.get(quant, dtype_bytes)
    heads = 1 if getattr(cfg, "tie_word_embeddings", False) else 2
    return int(proj + heads * cfg.vocab_size * cfg.hidden_size * dtype_bytes)


def _kv_bytes(cfg, batch: int, length: int, dtype_bytes: int) -> int:
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * length * batch * dtype_bytes


def estimate(args, shape: str, dtype: torch.dtype) -> dict:
    """Peak bytes of one shape's part of the run, by what holds them."""
    from benchmarks.harness.shapes import config_for

    cfg = config_for(shape)
    nbytes = torch.empty((), dtype=dtype).element_size()
    batch = max(int(b) for b in args.batch_sizes.split(","))
    length = args.prompt_len + args.new_tokens
    parts = {"weights": _weight_bytes(cfg, nbytes, args.quant), "kv_cache": _kv_bytes(cfg, batch, length, nbytes)}
    peers = [m for m in args.peers.split(",") if m] if shape in args.peer_shapes.split(",") else []
    if peers:
        peer_batch = max(int(b) for b in args.peer_batch_sizes.split(","))
        # transformers' dynamic and static caches; with --quant its torchao twin has weights of its own
        parts["peer_caches"] = 2 * _kv_bytes(cfg, peer_batch, length, nbytes)
        if args.quant:
            parts["peer_weights"] = _weight_bytes(cfg, nbytes, None)
    prefill = max([int(x) for x in args.prefill.split(",") if x] or [0])
    if prefill:  # transformers' full-sequence logits (float32) and one MLP's activations
        parts["prefill"] = prefill * (cfg.vocab_size * 4 + 3 * cfg.intermediate_size * nbytes)
    return parts


def available_bytes(device) -> int:
    """Free memory on ``device``: the GPU's free bytes; on the CPU MemAvailable, lowered to the cgroup's limit."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 1 << 62  # unknown: no check
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):  # fmt: skip
        try:
            with open(limit) as f, open(usage) as g:
                text = f.read().strip()
                if text != "max":
                    free = min(free, int(text) - int(g.read()))
        except (OSError, ValueError):
            continue
    return free


def check_memory(args, device, dtype, available: int | None = None) -> str | None:
    """One error line when a shape of the run would not fit, else None."""
    free = available_bytes(device) if available is None else available
    shapes = [s for s in args.shapes.split(",") if s] + (["llama2-70b-block"] if args.block70b else [])
    for shape in shapes:
        parts = estimate(args, shape, dtype)
        need = SLACK * sum(parts.values()) + FIXED_BYTES
        if need > free:
            detail = ", ".join(f"{k.replace('_', ' ')} {v / GB:.1f}" for k, v in parts.items() if v)
            return (f"error: --shapes {shape} (batch up to {max(int(b) for b in args.batch_sizes.split(','))}, "
                    f"{str(dtype)[6:]}) needs about {need / GB:.1f} GB on the {device.type} ({detail} GB, plus "
                    f"runtime), {free / GB:.1f} GB is free: give a smaller --shapes or --batch_sizes (the CPU: "
                    "--shapes tiny)")  # fmt: skip
    return None
