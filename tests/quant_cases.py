"""Conformance cases for the ops on quantized weights (``linear_q``, ``swiglu_linear_q``), used by
tests/test_kernels_conformance.py (CASES) and tests/test_quantization.py.

Every format, K not a multiple of the kernels' tiles (a partial int4 group and fp8 block), N not a multiple of their
row blocks, x a strided view as the model passes it; one row (the GEMV), a decode batch (the int4 / int8 GEMM; other
formats declined to the next choice) and more rows (prefill on the GPU: dequantize + matmul); int4 also with an
act-order g_idx; fp8 with N a multiple of 16 so ``torch._scaled_mm`` takes bf16 inputs.
"""

import dataclasses
import functools

import torch

from polyfuse.ops.act_int8 import PAIRED_BLOCKS
from polyfuse.ops.quant_formats import (
    FORMATS,
    GGUF_BYTES,
    GGUF_SUPER,
    GGUF_WEIGHTS,
    K_QUANTS,
    QuantizedWeight,
    quantize,
)


def act_order(qw):
    """An int4 weight as an act-order GPTQ checkpoint holds it: the same values, g_idx a permutation's groups (the
    weights' K order shuffled into groups; here the dequantized weight changes, which is fine for conformance)."""
    k = qw.shape[1]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(k))
    return dataclasses.replace(qw, g_idx=qw.g_idx[perm].contiguous(), act_order=True)


@functools.lru_cache(maxsize=None)
def _quantized_on_host(fmt: str, n: int, k: int, seed: int):
    """The packed weight, quantized once per session on the CPU: every conformance test of a quantized op builds the
    cases of every format, and on a GPU those are up to 14336 x 4096 weights (the GGUF ones by the gguf package's
    numpy code), which took most of the CUDA suite's time when each test quantized them again."""
    gen = torch.Generator().manual_seed(seed + n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    qw = quantize(fmt.replace("_act", ""), w)
    return act_order(qw) if fmt == "int4_act" else qw


def random_gguf(fmt: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """A GGUF weight of random bytes: every quant pattern (the K-quants: every scale and min, Q6_K's negative scales),
    and fp16 d / dmin / m of both signs, zero in every fourth (super-)block (what llama.cpp's files hold and our
    quantizer never writes)."""
    gen = torch.Generator().manual_seed(seed)
    nb, nbytes = k // GGUF_WEIGHTS[fmt], GGUF_BYTES[fmt]
    raw = torch.randint(0, 256, (n, nb, nbytes), generator=gen, dtype=torch.uint8)
    for at in {"gguf_q6_k": (208,), "gguf_q8_0": (0,), "gguf_q4_0": (0,)}.get(fmt, (0, 2)):
        d = (torch.rand(n, nb, generator=gen) - 0.3) * 0.01
        d[:, ::4] = 0.0
        raw[..., at : at + 2] = d.half().view(torch.uint8).reshape(n, nb, 2)
    return QuantizedWeight(fmt, (n, k), raw.reshape(n, nb * nbytes))


def quantized(fmt: str, n: int, k: int, device, seed: int = 0):
    """A random [n, k] weight quantized to ``fmt`` (``int4_act``: int4 with an act-order g_idx) on ``device``; a copy
    of the session's cached one, so a test may change its tensors."""
    qw = _quantized_on_host(fmt, n, k, seed)
    moved = {
        f.name: getattr(qw, f.name) for f in dataclasses.fields(qw) if isinstance(getattr(qw, f.name), torch.Tensor)
    }
    return dataclasses.replace(qw, **{name: t.to(device, copy=True) for name, t in moved.items()})


CASE_FORMATS = (*FORMATS, "int4_act")


def _shapes(big, fmt=None):
    """The cases' shapes; a GGUF K-quant's K rounded up to its 256-weight super-blocks."""
    if fmt in K_QUANTS:
        return [(lead, -(-k // GGUF_SUPER) * GGUF_SUPER, n) for lead, k, n in _shapes(big)]
    if fmt in PAIRED_BLOCKS and not big:  # K = 288 is 9 blocks, which the int8-activation GEMV declines; 320 it runs
        return [*_float_shapes(big), ((1, 1), 320, 40)]
    return _float_shapes(big)


def _float_shapes(big):
    # (leading dims of x, K, N): one row (the GEMV), a decode batch of 16 and 6 / 28 rows (the GEMM for int4, int8
    # and fp8), a 128-token (GPU) / 80-token (CPU) prefill (dequantize + matmul; fp8: its activations quantized)
    if big:
        return [((1, 1), 4096, 4096), ((1, 1), 14336, 4096), ((4, 7), 4096, 1024), ((16, 1), 4096, 6144),
                ((1, 128), 4096, 1024)]  # fmt: skip
    return [((1, 1), 288, 40), ((3, 2), 96, 24), ((16, 1), 256, 72), ((2, 40), 96, 24)]


BIAS_LEADS = ((1, 1), (16, 1))


def cases_linear_q(device, dtype, big):
    out = []
    for fmt in CASE_FORMATS:
        for lead, k, n in _shapes(big, fmt):
            if fmt == "fp8":
                n = 48 if not big else n  # a multiple of 16: scaled_mm takes it
            gen = torch.Generator().manual_seed(k + n)
            x0 = (torch.randn(*lead, k + 8, generator=gen)).to(dtype).to(device)
            qw = quantized(fmt, n, k, device)
            bias = (torch.randn(n, generator=gen) * 0.1).to(dtype).to(device) if lead in BIAS_LEADS else None

            def make(x0=x0, qw=qw, bias=bias, k=k):
                return (x0[..., :k], qw, bias), {}, []

            out.append((f"{fmt}-x{lead}K{k}N{n}{'-bias' if bias is not None else ''}", make))
    return out


def cases_swiglu_linear_q(device, dtype, big):
    out = []
    for fmt in CASE_FORMATS:
        for lead, i, n in _shapes(big, fmt):
            if fmt == "fp8":
                n = 48 if not big else n  # a multiple of 16: the fp8 scaled_mm implementation takes it
            gen = torch.Generator().manual_seed(i + n + 1)
            gu0 = (torch.randn(*lead, 2 * i, generator=gen) * 2).to(dtype).to(device)
            qw = quantized(fmt, n, i, device, seed=1)

            def make(gu0=gu0, qw=qw, i=i):
                return (gu0[..., :i], gu0[..., i:], qw), {}, []

            out.append((f"{fmt}-x{lead}I{i}N{n}", make))
    return out


def cases_add_rms_norm_linear_q(device, dtype, big):
    """The layer's norm (with a residual, or without: the first layer) and the quantized projection of its rows; the
    fp8 prefill implementation takes the many-row cases (more than 64 rows: (1, 128) on the GPU, (2, 40) here)."""
    out = []
    for fmt in CASE_FORMATS:
        for lead, k, n in _shapes(big, fmt):
            if fmt == "fp8":
                n = 48 if not big else n
            gen = torch.Generator().manual_seed(k + n + 2)
            x0 = torch.randn(*lead, k + 8, generator=gen).to(dtype).to(device)
            res = (torch.randn(*lead, k, generator=gen) * 4).to(dtype).to(device)
            w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(device)
            qw = quantized(fmt, n, k, device, seed=2)
            bias = (torch.randn(n, generator=gen) * 0.5).to(dtype).to(device)
            for with_res, with_bias in ((True, False), (False, False), (True, True)):

                def make(x0=x0, res=res, w=w, qw=qw, k=k, with_res=with_res, b=bias if with_bias else None):
                    return (x0[..., :k], res if with_res else None, w, 1e-5, qw, b), {}, []

                out.append((f"{fmt}-x{lead}K{k}N{n}{'-res' if with_res else ''}{'-bias' if with_bias else ''}", make))
    return out


def tile_options(folder, kind: str = "qgemv", **kw):
    """Kernel options whose ``tile_configs`` folder (``folder``, made here) replaces entries of the package's
    ``kind`` table (configs/<kind>/default.json): ``kw`` maps a format (or op) to its entry, or to a function of
    the package's entry (e.g. ``int4=lambda e: {**e, "prefetch_regs": 0}``); other keys of KernelOptions pass
    through (``pdl=False``)."""
    import json
    import pathlib

    from polyfuse.backends.triton import tuned
    from polyfuse.core.kernel_options import FIELDS, KernelOptions

    options = {k: kw.pop(k) for k in list(kw) if k in FIELDS}
    base = tuned.table(kind, "")
    where = pathlib.Path(folder) / kind
    where.mkdir(parents=True, exist_ok=True)
    entries = {name: (entry(base.get(name, {})) if callable(entry) else entry) for name, entry in kw.items()}
    (where / "default.json").write_text(json.dumps(entries))
    return KernelOptions(tile_configs=str(folder), **options)


def no_prefetch(folder):
    """Kernel options under which no one-row GEMV loads weights before its PDL wait (int4's prefetch_regs 0)."""
    return tile_options(folder, int4=lambda e: {**e, "prefetch_regs": 0})
