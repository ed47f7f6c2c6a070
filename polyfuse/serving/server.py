"""``polyfuse serve``: load the model as run_generation.py does, size the paged KV cache, start the engine thread and
uvicorn. SIGTERM stops new connections, lets in-flight requests finish for up to --shutdown_timeout seconds, cancels
the rest (their blocks freed), and exits 0; SIGINT exits 130. Under torchrun rank 0 serves and the other ranks
follow its steps (tp.py)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time

import torch

from polyfuse.cli.generate import UsageError, load, pick_device, set_log_level
from polyfuse.core import settings
from polyfuse.core.errors import CheckpointError, one_line
from polyfuse.distributed.launch import distributed_entry
from polyfuse.serving.cli import build_parser, speculative_setting_of, validate
from polyfuse.serving.engine import Engine, EngineConfig
from polyfuse.serving.kv_cache import bytes_per_block


logger = logging.getLogger("polyfuse")
GB = 1024**3
API_KEY_ENV = "POLYFUSE_API_KEY"  # the server's own variable, as vLLM reads VLLM_API_KEY
SERVE_FLAGS = ("use_flash_attention", "use_cuda_graphs", "use_hpu_graphs", "limit_hpu_graphs")


def activation_reserve(model, tokens: int, max_len: int, seqs: int) -> int:
    """Bytes a step of ``tokens`` rows may need beside the weights and the cache: the layer's activations, the
    native prefill attention's scores (queries x keys, fp32, twice) and the logits of ``seqs`` rows."""
    cfg, e = model.config, torch.empty((), dtype=model.dtype).element_size()
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    acts = tokens * (4 * hidden + 3 * inter) * e * 2
    scores = tokens * cfg.num_attention_heads * max_len * 4 * 2
    return acts + scores + seqs * cfg.vocab_size * 4 * 4 + GB


def size_cache(model, args) -> tuple:
    """(KV blocks, max_model_len) for this run, or a UsageError saying what to change."""
    layers, kv_heads, hd = model.kv_cache_layout()
    per_block = bytes_per_block(layers, args.block_size, kv_heads, hd, model.dtype)
    positions = model.config.max_position_embeddings
    max_len = args.max_model_len or positions
    if max_len > positions:
        raise UsageError(f"--max_model_len {max_len} exceeds the model's {positions} positions")
    blocks_per_seq = -(-max_len // args.block_size)
    if args.num_kv_blocks is not None:
        blocks = args.num_kv_blocks
    elif model.device.type == "cpu":
        blocks = min(args.max_num_seqs * blocks_per_seq + 1, int(args.kv_cache_memory_gb * GB // per_block))
    else:
        stats = model.runtime.memory_stats()
        total = stats.get("total_memory_available (GB)", 0) * GB
        used = torch.cuda.memory_allocated(model.device) if model.device.type == "cuda" else (
            stats.get("memory_allocated (GB)", 0) * GB)  # fmt: skip
        reserve = activation_reserve(model, args.max_num_batched_tokens, max_len, args.max_num_seqs)
        blocks = int((total * args.gpu_memory_utilization - used - reserve) // per_block)
    if blocks < 2:
        raise UsageError(f"no room for a KV cache ({blocks} blocks of {per_block / 2**20:.1f} MiB): lower --max_model_len "
                         "or --max_num_batched_tokens, raise --gpu_memory_utilization, or give --num_kv_blocks")  # fmt: skip
    capacity = (blocks - 1) * args.block_size
    if max_len > capacity:
        if args.max_model_len is not None:
            raise UsageError(f"--max_model_len {max_len} does not fit the KV cache ({blocks - 1} blocks of "
                             f"{args.block_size} tokens = {capacity}); give more memory or a shorter --max_model_len")  # fmt: skip
        print(f"warning: max_model_len {max_len} (the model's positions) does not fit the KV cache: serving "
              f"{capacity} tokens per sequence", file=sys.stderr)  # fmt: skip
        max_len = capacity
    return blocks, max_len


def build(args, channel=None):
    """(engine, model name): the model and tokenizer loaded as run_generation.py loads them, the cache sized."""
    from polyfuse.core.flags import check_flags

    device = pick_device(args.device)
    flags = {name: getattr(args, name) for name in SERVE_FLAGS}
    flags, warnings = check_flags(device.type, flags)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    torch.manual_seed(args.seed)
    model, tokenizer = load(args, device, flags)
    if channel is None:
        from polyfuse.distributed.context import current

        if current().active:  # a TP model: the step channel is made by every rank, after the model's group
            from polyfuse.serving.tp import StepChannel

            channel = StepChannel()
    blocks, max_len = size_cache(model, args)
    config = EngineConfig(max_len, blocks, args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                          args.enable_prefix_caching, args.bucket_size, args.seed,
                          speculative_setting_of(args), args.num_scheduler_steps)  # fmt: skip
    if channel is not None:
        config = channel.agree(config)
    broadcast = channel.send if channel is not None and channel.rank == 0 else None
    if channel is not None and channel.rank == 0 and config.num_scheduler_steps > 1:
        print(f"warning: --num_scheduler_steps {config.num_scheduler_steps}: tensor-parallel serving runs one "
              "decode step per scheduling", file=sys.stderr)  # fmt: skip
    engine = Engine(model, tokenizer, config, broadcast=broadcast)
    engine.runner.warmup()
    if args.print_backends and (channel is None or channel.rank == 0):
        print(model.kernels.report())
        if config.speculative is not None:
            spec = config.speculative
            print(f"speculative decoding: prompt_lookup (n-gram matching, n <= {spec.ngram}), k={spec.k}")
    name = args.served_model_name or args.model_name_or_path
    if name is None:
        from polyfuse.models.builtin import BUILTIN_NAME

        name = BUILTIN_NAME
    return engine, name, channel


def make_server(engine, name: str, args, on_stop=None):
    """(uvicorn server, its bound socket, the async engine) for ``engine``, not started."""
    import uvicorn

    from polyfuse.serving.api import ServerState, create_app
    from polyfuse.serving.async_engine import AsyncEngine
    from polyfuse.serving.metrics import Metrics
    from polyfuse.serving.protocol import Context

    metrics = Metrics(name)
    idle = (lambda: engine.broadcast("idle")) if engine.broadcast is not None else None
    aengine = AsyncEngine(engine, args.max_waiting, metrics, idle=idle)
    vocab = engine.model.config.vocab_size
    ctx = Context(name, engine.tokenizer, engine.config.max_model_len, vocab)
    api_key = args.api_key if args.api_key is not None else settings.get(API_KEY_ENV) or None
    state = ServerState(aengine, ctx, metrics, api_key, int(time.time()))

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        aengine.start()
        try:
            yield
        finally:
            aengine.drain()
            aengine.stop()
            if on_stop is not None:
                on_stop()

    app = create_app(state, lifespan)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None
    sock.listen(2048)
    level = args.log_level
    config = uvicorn.Config(app, log_level=level, access_log=level in ("debug", "info"), lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout)  # fmt: skip

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            aengine.drain()  # requests still arriving on open connections get 503
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)  # drained: exit 0 rather than re-raise SIGTERM

    return Server(config), sock, aengine


def run(args) -> int:
    validate(args)
    engine, name, channel = build(args)
    if channel is not None and channel.rank != 0:
        from polyfuse.serving.tp import follow

        follow(engine.runner, channel)
        return 0
    on_stop = (lambda: channel.send(None)) if channel is not None else None
    server, sock, _ = make_server(engine, name, args, on_stop)
    host, port = sock.getsockname()[:2]
    blocks = engine.blocks
    spec = engine.config.speculative
    extra = f"; prompt lookup k={spec.k}" if spec is not None else ""
    extra += f"; {engine.multi_steps} scheduler steps" if engine.multi_steps > 1 else ""
    print(f"polyfuse serve: {name} on http://{host}:{port} (pid {os.getpid()}; {blocks.usable_blocks} KV blocks of "
          f"{blocks.block_size} tokens, max_model_len {engine.config.max_model_len}, max_num_seqs "
          f"{engine.config.max_num_seqs}{extra})", flush=True)  # fmt: skip
    server.run(sockets=[sock])
    return 0


@distributed_entry  # under torchrun: tensor parallel over its world, rank 0 serves (docs/serving.md)
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    set_log_level(args.log_level)
    try:
        return run(args)
    except (UsageError, CheckpointError, ValueError, FileNotFoundError) as e:
        print("error: " + one_line(e), file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError:
        print("error: out of GPU memory; lower --gpu_memory_utilization, --max_num_batched_tokens or --max_num_seqs",
              file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:
        return 130
