"""Tensor parallelism on torch.distributed: process groups from the platform (NCCL / HCCL / gloo), the rank's
context, how a decoder is split, and the torchrun entry points (docs/distributed.md).

Imports only ``polyfuse.core`` (and torch), so the engine and the models can use it."""

from polyfuse.distributed.context import (
    SINGLE,
    TPContext,
    agree,
    backend_for,
    building,
    building_context,
    current,
    for_build,
    init,
    request_from_env,
    shutdown,
)
from polyfuse.distributed.sharding import HeadShard, Shard, TensorParallelError, head_shard, split


__all__ = [
    "SINGLE",
    "HeadShard",
    "Shard",
    "TPContext",
    "TensorParallelError",
    "agree",
    "backend_for",
    "building",
    "building_context",
    "current",
    "for_build",
    "head_shard",
    "init",
    "request_from_env",
    "shutdown",
    "split",
]
