"""One row of activations quantized to int8 in blocks of 32 (polyfuse/ops/act_int8.py has the arithmetic), in the
layout the W4A8 GEMV reads. For AutoGPTQ's int4 (gemv_int4_a8.py), for word row r (values 8r .. 8r + 7) XW[2r] holds
the bytes of values 8r, 8r + 2, 8r + 4, 8r + 6 and XW[2r + 1] those of 8r + 1, .. 8r + 7 (low byte first: the even and
the odd nibbles of an int4 word, lined up for two integer dot products); for the GGUF K-quants (gemv_gguf_kquant_a8.py,
``natural``) XW[i] holds values 4i .. 4i + 3 in order, as their quant bytes hold consecutive weights. For block b (values 32b .. 32b + 31) DX[b] holds the scale d and
RS[b] = d * sum q (the block's dequantized sum, for the weights' zero points).

Three producers write it, each as its own kernel so the GEMV after it can launch first (_pdl.launch_then_wait) and
load weights while it runs: the layer's norm (add + RMSNorm, as rms_norm.py computes it, the sum written as the next
residual), SwiGLU (as swiglu.py computes it) and a plain row (the attention's output, the final norm's).
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._pdl import launch_then_wait, pdl_options
from polyfuse.backends.triton._rounding import PTX, cast_rne
from polyfuse.backends.triton.rms_norm import _launch_params
from polyfuse.core.kernel_options import DEFAULT
from polyfuse.ops.act_int8 import BLOCK as QBLOCK
from polyfuse.ops.act_int8 import TINY


_TINY = tl.constexpr(TINY)


@triton.jit
def _mul_rn(a, b, ASM: tl.constexpr):
    """a * b rounded to float32 (an explicit ``mul.rn``, which neither LLVM nor ptxas contracts into an FMA with the
    subtraction after it: the FMA's unrounded product made a few values round the other way on an H200)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def store_int8_blocks(v, b0, NB, XW, DX, RS, BLOCK: tl.constexpr, ASM: tl.constexpr, NATURAL: tl.constexpr):
    """float32 values v [BLOCK] of blocks b0 .. b0 + BLOCK / 32 - 1 (zeros past the row's NB blocks) -> XW, DX, RS
    (NATURAL: XW's words in the values' order, else the int4 GEMV's even / odd words)."""
    v2 = tl.reshape(v, [BLOCK // 32, 32])
    amax = tl.max(tl.abs(v2), axis=1)
    live = amax >= _TINY
    safe = tl.where(live, amax, 1.0)
    inv = tl.where(live, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), safe), 0.0)
    y = _mul_rn(v2, inv[:, None], ASM)  # rounded before the floor: no FMA may fold it into y - f
    f = tl.floor(y)  # round half to even without rint (which the interpreter lacks): exact in float32 here
    frac = y - f
    up = (frac > 0.5) | ((frac == 0.5) & ((f.to(tl.int32) & 1) == 1))
    q = tl.minimum(tl.maximum(f + tl.where(up, 1.0, 0.0), -127.0), 127.0).to(tl.int32)
    d = tl.where(live, tl.math.div_rn(safe, tl.full(amax.shape, 127.0, tl.float32)), 0.0)
    b = b0 + tl.arange(0, BLOCK // 32)
    tl.store(DX + b, d, mask=b < NB)
    tl.store(RS + b, d * tl.sum(q, axis=1).to(tl.float32), mask=b < NB)
    shift = 8 * tl.arange(0, 4)[None, :]
    if NATURAL:
        words = tl.sum((tl.reshape(q, [BLOCK // 4, 4]) & 0xFF) << shift, axis=1)
    else:
        even, odd = tl.split(tl.reshape(q, [BLOCK // 8, 4, 2]))
        words = tl.reshape(
            tl.join(tl.sum((even & 0xFF) << shift, axis=1), tl.sum((odd & 0xFF) << shift, axis=1)), [BLOCK // 4]
        )
    w = 8 * b0 + tl.arange(0, BLOCK // 4)
    tl.store(XW + w, words, mask=w < 8 * NB)


@triton.jit
def _quantize_kernel(
    X, U, XW, DX, RS, K, sx, su,
    SWIGLU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, NATURAL: tl.constexpr,
):  # fmt: skip
    """Grid (chunks of BLOCK values, rows): row m's values at X + m sx (U + m su), its words at XW + m K / 4, its
    blocks' scales and sums at DX / RS + m K / 32."""
    launch_then_wait(PDL)
    row = tl.program_id(1).to(tl.int64)
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(X + row * sx + k, mask=k < K, other=0.0).to(tl.float32)
    if SWIGLU:  # silu(gate) * up rounded once to the row's dtype, as swiglu.py stores it
        u = tl.load(U + row * su + k, mask=k < K, other=0.0).to(tl.float32)
        v = cast_rne(v * tl.sigmoid(v) * u, X.dtype.element_ty).to(tl.float32)
    nb = K // 32
    store_int8_blocks(v, tl.program_id(0) * (BLOCK // 32), nb, XW + row * (8 * nb), DX + row * nb, RS + row * nb,
                      BLOCK, ASM, NATURAL)  # fmt: skip


@triton.jit
def _norm_quantize_kernel(
    X,
    RES,
    R,
    W,
    XW,
    DX,
    RS,
    H,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr,
    NATURAL: tl.constexpr,
):
    launch_then_wait(PDL)
    k = tl.arange(0, BLOCK)
    mask = k < H
    x = tl.load(X + k, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # the sum rounded to its dtype before the statistics, as rms_norm.py
        r = cast_rne(x + tl.load(RES + k, mask=mask, other=0.0).to(tl.float32), R.dtype.element_ty)
        tl.store(R + k, r, mask=mask)
        x = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    xn = cast_rne(x * rstd, X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + k, mask=mask, other=0.0).to(tl.float32)
    xn = cast_rne(w * xn, X.dtype.element_ty).to(tl.float32)
    store_int8_blocks(xn, 0, H // 32, XW, DX, RS, BLOCK, ASM, NATURAL)


CHUNK = 1024  # values per program of the plain / SwiGLU kernel


def takes_rows(x: torch.Tensor, k: int, up=None) -> bool:
    """Whether the int8-activation GEMVs take a call's activations as rows of K values (``up``, SwiGLU's, of x's shape
    and dtype): a float dtype, inline PTX (NVIDIA, sm61+ for dp4a; not ROCm) or the CPU interpreter."""
    if x.shape[-1] != k or (up is not None and (up.shape != x.shape or up.dtype != x.dtype)):
        return False
    if torch.version.hip is not None or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) >= (6, 1)


def takes_row(x: torch.Tensor, k: int, up=None) -> bool:
    """takes_rows for one row of K values."""
    return x.numel() == k and takes_rows(x, k, up)


def _outputs(k: int, device, m: int = 1):
    if k % QBLOCK:
        raise ValueError(f"int8 activations: K={k} is not a multiple of {QBLOCK}")
    xw = torch.empty(m, k // 4, dtype=torch.int32, device=device)
    dx = torch.empty(m, k // QBLOCK, dtype=torch.float32, device=device)
    return xw, dx, torch.empty_like(dx)


def quantize_rows(x: torch.Tensor, up=None, natural: bool = False, options=DEFAULT):
    """x [M, K] (unit column stride; the gate with ``up`` of its shape and dtype for SwiGLU) -> (xw int32 [M, K / 4],
    dx, rs float32 [M, K / 32]); ``natural``: the GGUF GEMVs' word order."""
    if x.dim() != 2 or x.stride(-1) != 1 or (up is not None and (up.shape != x.shape or up.dtype != x.dtype)):
        raise ValueError("quantize_rows: rows [M, K] of unit column stride (and up of their shape and dtype)")
    if up is not None and up.stride(-1) != 1:
        up = up.contiguous()
    m, k = x.shape
    xw, dx, rs = _outputs(k, x.device, m)
    block = min(CHUNK, triton.next_power_of_2(k))
    u = up if up is not None else x
    _quantize_kernel[(triton.cdiv(k, block), m)](
        x, u, xw, dx, rs, k, x.stride(0), u.stride(0), SWIGLU=up is not None, BLOCK=block, ASM=PTX,
        NATURAL=natural, num_warps=4, **pdl_options(x.device, options),
    )  # fmt: skip
    return xw, dx, rs


def quantize_row(x: torch.Tensor, up=None, natural: bool = False, options=DEFAULT):
    """x [K] or [1, K] (dense; the gate with ``up`` of its dtype for SwiGLU) -> (xw int32 [K / 4], dx, rs float32
    [K / 32]); ``natural``: the K-quant GEMV's word order."""
    k = x.shape[-1]
    if x.numel() != k or (up is not None and (up.shape != x.shape or up.dtype != x.dtype)):
        raise ValueError("quantize_row: one row (and up of its shape and dtype)")
    xw, dx, rs = quantize_rows(x.reshape(1, k), None if up is None else up.reshape(1, k), natural, options)
    return xw.view(-1), dx.view(-1), rs.view(-1)


def norm_quantize_row(x: torch.Tensor, residual, weight: torch.Tensor, eps: float, natural=False, options=DEFAULT):
    """add + RMSNorm of one dense row x [H] (residual: [H] or None; weight of x's dtype), quantized ->
    (xw, dx, rs, x + residual in x's dtype, or x itself without a residual); ``natural`` as quantize_row's."""
    h = x.shape[-1]
    if x.numel() != h:
        raise ValueError("norm_quantize_row: one row")
    xw, dx, rs = (t.view(-1) for t in _outputs(h, x.device))
    r = torch.empty_like(x) if residual is not None else x
    block, num_warps = _launch_params(h)  # rms_norm.py's: the same sum of squares, in the same order
    _norm_quantize_kernel[(1,)](
        x, residual if residual is not None else x, r, weight, xw, dx, rs, h, float(eps),
        HAS_RES=residual is not None, BLOCK=block, ASM=PTX, NATURAL=natural, num_warps=num_warps,
        **pdl_options(x.device, options),
    )  # fmt: skip
    return xw, dx, rs, r
