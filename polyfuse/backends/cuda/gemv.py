"""Triton GEMV for decode: y[M, N] = x[M, K] @ w[N, K]^T for a handful of rows (M <= 4), optionally with SwiGLU
applied to x on the fly (x = silu(gate) * up, the down projection's input, so SwiGLU needs no launch of its own).

Each program owns BLOCK_N output columns and reads its [BLOCK_N, K] slice of the weight once, in [BLOCK_N, BLOCK_K]
tiles, accumulating w * x elementwise in fp32 and reducing once at the end; no split-K, so no second reduction
kernel (cuBLAS picks split-K plus a reduce kernel for the narrow decode GEMMs). Inference only (no backward).
It beats cuBLAS only on some shapes (measured by ``examples/benchmark_linear.py``): ``linear`` and
``swiglu_linear`` below use it for the shapes of the ``TUNED`` table and leave every other call to cuBLAS.
"""

import json
import os

import torch
import triton
import triton.language as tl

from polyfuse.backends.cuda._rounding import cast_rne


@triton.jit
def _gemv_kernel(
    X, U, W, Y, N, K, sx_m, su_m, sw_n, sy_m,
    M: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
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
         num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:  # fmt: skip
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
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y


# Measured on one H200 (examples/benchmark_linear.py; docs/benchmarks.md has the table): the (N, K, SwiGLU) decode
# shapes where the GEMV beat cuBLAS at one row by more than 2%, with the winning (block_n, block_k, num_warps,
# num_stages). Every other shape, and more than one row, goes to cuBLAS. POLYFUSE_GEMV_TABLE=<json> replaces the
# table (for tuning runs): a list of [N, K, swiglu, block_n, block_k, num_warps, num_stages].
TUNED = {
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
}


def _table() -> dict:
    path = os.environ.get("POLYFUSE_GEMV_TABLE")
    if not path:
        return TUNED
    with open(path) as f:
        return {(n, k, bool(sw)): tuple(cfg) for n, k, sw, *cfg in json.load(f)}


TABLE = _table()


def _tuned_gemv(x: torch.Tensor, weight: torch.Tensor, bias, up=None):
    """The GEMV's result for a tuned one-row shape, else None (the caller runs the library path)."""
    k = x.shape[-1]
    if bias is not None or weight.dim() != 2 or x.numel() != k or x.dtype != weight.dtype:
        return None
    cfg = TABLE.get((weight.shape[0], k, up is not None))
    if cfg is None or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return None
    bn, bk, nw, ns = cfg
    y = gemv(x.reshape(1, k), weight, None if up is None else up.reshape(1, k), bn, bk, nw, ns)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear``, with the tuned one-row decode shapes on the Triton GEMV."""
    y = _tuned_gemv(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias) if y is None else y


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """The down projection of silu(gate) * up: the GEMV applies SwiGLU in its loads for the tuned one-row shapes;
    otherwise the Triton SwiGLU kernel, then cuBLAS."""
    y = _tuned_gemv(gate, weight, bias, up)
    if y is None:
        from polyfuse.backends.cuda.swiglu import swiglu

        return torch.nn.functional.linear(swiglu(gate, up), weight, bias)
    return y
