"""Where the Triton GEMV beats cuBLAS, per GPU: tables measured with ``benchmarks/benchmark_linear.py`` apply only to
the platform and the GPU product they were measured on (``TUNED`` is keyed by ``torch.cuda.get_device_name``), so
another GPU, or a ROCm device, keeps cuBLAS until someone tunes it. docs/architecture.md says how to add a table.

The GEMV implementations of ``linear`` / ``swiglu_linear`` accept a call only for a one-row input of a tuned
(N, K, SwiGLU) shape without bias or gradients; every other call goes to the registry's next choice.
``POLYFUSE_GEMV_TABLE=<json>`` replaces the table for any GPU (for tuning runs): a list of
[N, K, swiglu, block_n, block_k, num_warps, num_stages].
"""

import json
import os
from typing import Optional

import torch


# Measured on one H200 (benchmarks/benchmark_linear.py; docs/benchmarks.md has the table): the (N, K, SwiGLU) decode
# shapes where the GEMV beat cuBLAS at one row by more than 2%, with the winning (block_n, block_k, num_warps,
# num_stages). Every other shape, and more than one row, goes to cuBLAS. POLYFUSE_GEMV_TABLE=<json> replaces the
# table (for tuning runs): a list of [N, K, swiglu, block_n, block_k, num_warps, num_stages].
H200 = {
    # Llama-3-8B: qkv, o, gate/up, down (plain and with SwiGLU folded in), LM head
    (6144, 4096, False): (4, 4096, 8, 2),
    (4096, 4096, False): (4, 4096, 8, 2),
    (28672, 4096, False): (4, 4096, 8, 2),
    (4096, 14336, False): (8, 2048, 4, 3),
    (4096, 14336, True): (8, 512, 8, 2),
    (128256, 4096, False): (8, 2048, 4, 2),
    # Llama-2-7B (its o_proj is the 8B's): qkv, gate/up, down (plain and with SwiGLU), LM head
    (12288, 4096, False): (4, 4096, 8, 3),
    (22016, 4096, False): (4, 4096, 8, 3),
    (4096, 11008, False): (4, 4096, 8, 2),
    (4096, 11008, True): (32, 1024, 8, 2),
    (32000, 4096, False): (4, 4096, 8, 2),
    # Llama-2-13B: only down won (qkv, o, gate/up and the LM head stay on cuBLAS)
    (5120, 13824, False): (4, 4096, 8, 3),
    (5120, 13824, True): (8, 512, 8, 3),
    # Llama-2-70B: qkv, o, gate/up, down (plain and with SwiGLU)
    (10240, 8192, False): (4, 4096, 8, 3),
    (8192, 8192, False): (4, 4096, 8, 2),
    (57344, 8192, False): (4, 4096, 8, 2),
    (8192, 28672, False): (4, 4096, 8, 2),
    (8192, 28672, True): (32, 512, 4, 3),
    # One rank's shards under tensor parallelism over 2 GPUs (run 17): Llama-3-8B qkv, o, gate/up, down (plain and
    # with SwiGLU), LM head; Llama-2-70B qkv, gate/up, down (its o shard stays on cuBLAS)
    (3072, 4096, False): (4, 4096, 8, 2),
    (4096, 2048, False): (8, 1024, 4, 2),
    (14336, 4096, False): (4, 4096, 8, 2),
    (4096, 7168, False): (8, 2048, 4, 3),
    (4096, 7168, True): (8, 512, 8, 3),
    (64128, 4096, False): (8, 2048, 4, 3),
    (5120, 8192, False): (4, 4096, 8, 3),
    (28672, 8192, False): (4, 4096, 8, 2),
    (8192, 14336, False): (8, 2048, 4, 2),
    (8192, 14336, True): (32, 512, 4, 2),
}


TUNED = {"NVIDIA H200": H200}


def table_for(device_name: str) -> dict:
    path = os.environ.get("POLYFUSE_GEMV_TABLE")
    if path:
        with open(path) as f:
            return {(n, k, bool(sw)): tuple(cfg) for n, k, sw, *cfg in json.load(f)}
    return TUNED.get(device_name, {})


# The table in force for this process, set by the probe from the run's GPU (tests replace it).
TABLE: dict = {}


def _refusal(x: torch.Tensor, weight: torch.Tensor, bias, swiglu: bool) -> Optional[str]:
    k = x.shape[-1]
    if bias is not None or weight.dim() != 2 or x.numel() != k or x.dtype != weight.dtype:
        return "not a one-row bias-free decode projection"
    if (weight.shape[0], k, swiglu) not in TABLE:
        return "shape not in the tuned table"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return "needs gradients"
    return None


def accepts_linear(x, weight, bias=None) -> Optional[str]:
    return _refusal(x, weight, bias, False)


def accepts_swiglu_linear(gate, up, weight, bias=None) -> Optional[str]:
    return _refusal(gate, weight, bias, True)


def linear(x, weight, bias=None):
    from polyfuse.backends.triton.gemv import tuned_linear

    return tuned_linear(x, weight, TABLE[(weight.shape[0], x.shape[-1], False)])


def swiglu_linear(gate, up, weight, bias=None):
    from polyfuse.backends.triton.gemv import tuned_swiglu_linear

    return tuned_swiglu_linear(gate, up, weight, TABLE[(weight.shape[0], gate.shape[-1], True)])
