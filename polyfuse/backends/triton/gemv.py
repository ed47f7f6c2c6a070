"""Triton GEMV for decode: y[M, N] = x[M, K] @ w[N, K]^T for a handful of rows (M <= 4), optionally with SwiGLU
applied to x on the fly (x = silu(gate) * up, the down projection's input, so SwiGLU needs no launch of its own).

Each program owns BLOCK_N output columns and reads its [BLOCK_N, K] slice of the weight once, in [BLOCK_N, BLOCK_K]
tiles, accumulating w * x elementwise in fp32 and reducing once at the end; no split-K, so no second reduction
kernel (cuBLAS picks split-K plus a reduce kernel for the narrow decode GEMMs). Inference only (no backward).
It beats cuBLAS only on some shapes (measured by ``benchmarks/benchmark_linear.py``): which shapes, with which tiles,
is a per-GPU table (configs/gemv/<GPU>.json, tuned.py; keyed by the name ``torch.cuda.get_device_name`` reports, so
another GPU, or a ROCm device, keeps cuBLAS until someone tunes it). ``linear`` / ``swiglu_linear`` (the
implementations ``triton_gemv`` of those ops) take a one-row input of a tuned (N, K) shape without bias or gradients;
``accepts_*`` decline every other call to the registry's next choice.
"""

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton import tuned
from polyfuse.backends.triton._pdl import pdl_options, wait_prior
from polyfuse.backends.triton._rounding import cast_rne
from polyfuse.core.kernel_options import DEFAULT


@triton.jit
def _gemv_kernel(
    X, U, W, Y, N, K, sx_m, su_m, sw_n, sy_m,
    M: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_prior(PDL)
    pid = tl.program_id(0).to(tl.int64)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    kk = tl.arange(0, BLOCK_K)
    for m in tl.static_range(M):
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            if EVEN_K:
                x = tl.load(X + m * sx_m + k).to(tl.float32)
                if SWIGLU:
                    u = tl.load(U + m * su_m + k).to(tl.float32)
                w = tl.load(W + n[:, None] * sw_n + k[None, :], mask=n_mask[:, None], other=0.0)
            else:
                k_mask = k < K
                x = tl.load(X + m * sx_m + k, mask=k_mask, other=0.0).to(tl.float32)
                if SWIGLU:
                    u = tl.load(U + m * su_m + k, mask=k_mask, other=0.0).to(tl.float32)
                w = tl.load(W + n[:, None] * sw_n + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if SWIGLU:
                # silu(gate) rounded to the storage dtype, times up, rounded again: what the two-kernel path stores
                g = cast_rne(x / (1.0 + tl.exp(-x)), W.dtype.element_ty).to(tl.float32)
                x = cast_rne(g * u, W.dtype.element_ty).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        tl.store(Y + m * sy_m + n, cast_rne(y, Y.dtype.element_ty), mask=n_mask)


def gemv(x: torch.Tensor, w: torch.Tensor, up: torch.Tensor = None, block_n: int = 16, block_k: int = 512,
         num_warps: int = 4, num_stages: int = 3, options=DEFAULT) -> torch.Tensor:  # fmt: skip
    """x [M, K] (or the gate half with ``up`` [M, K] for SwiGLU), w [N, K] -> [M, N] in w's dtype."""
    m, k = x.shape
    n = w.shape[0]
    if w.stride(-1) != 1:
        w = w.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if up is not None and up.stride(-1) != 1:
        up = up.contiguous()
    y = torch.empty((m, n), dtype=w.dtype, device=w.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, up if up is not None else x, w, y, n, k, x.stride(0), (up if up is not None else x).stride(0),
        w.stride(0), y.stride(0),
        M=m, SWIGLU=up is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(w.device, options),
    )  # fmt: skip
    return y


@functools.lru_cache(maxsize=None)
def table_for(device_name: str, override: str = "") -> dict:
    """{(N, K, swiglu): (block_n, block_k, num_warps, num_stages)} of the GPU named ``device_name`` (empty for a GPU
    nobody tuned), with the ``tile_configs`` folder ``override``'s entries over it."""
    table = tuned.table("gemv", device_name, override)
    return {
        (*tuned.shape_key(shape), op == "swiglu_linear"): tuple(tile)
        for op in ("linear", "swiglu_linear")
        for shape, tile in table.get(op, {}).items()
    }


def _tiles(weight: torch.Tensor, k: int, swiglu: bool, options) -> Optional[tuple]:
    return table_for(tuned.gpu_name(weight.device), options.tile_configs).get((weight.shape[0], k, swiglu))


def _refusal(x: torch.Tensor, weight: torch.Tensor, bias, swiglu: bool, options) -> Optional[str]:
    k = x.shape[-1]
    if bias is not None or weight.dim() != 2 or x.numel() != k or x.dtype != weight.dtype:
        return "not a one-row bias-free decode projection"
    if _tiles(weight, k, swiglu, options) is None:
        return "shape not in the tuned table"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return "needs gradients"
    return None


def accepts_linear(x, weight, bias=None, options=DEFAULT) -> Optional[str]:
    return _refusal(x, weight, bias, False, options)


def accepts_swiglu_linear(gate, up, weight, bias=None, options=DEFAULT) -> Optional[str]:
    return _refusal(gate, weight, bias, True, options)


def linear(x, weight, bias=None, options=DEFAULT):
    """``F.linear(x, weight)`` for one row of a tuned shape, with its tiles."""
    k = x.shape[-1]
    cfg = _tiles(weight, k, False, options)
    return gemv(x.reshape(1, k), weight, None, *cfg, options=options).view(*x.shape[:-1], weight.shape[0])


def swiglu_linear(gate, up, weight, bias=None, options=DEFAULT):
    """``F.linear(silu(gate) * up, weight)`` for one row of a tuned shape, SwiGLU applied in the GEMV's loads."""
    k = gate.shape[-1]
    cfg = _tiles(weight, k, True, options)
    return gemv(gate.reshape(1, k), weight, up.reshape(1, k), *cfg, options=options).view(
        *gate.shape[:-1], weight.shape[0]
    )
