"""The dequantizing GEMM on GGUF weights kept as stored (backends/triton/quant/gemm_gguf.py: batch decode past the
int8-activation GEMV's rows): every type on our packing and on (super-)blocks of random bytes, against the float64
product of the reference's dequantized weight; splits of K, bias, SwiGLU folded into the activation loads."""

import dataclasses

import pytest
import torch
from helpers import one_thread  # noqa: F401  (autouse)
from quant_cases import random_gguf

from polyfuse.ops import quant_formats as qf


pytest.importorskip("triton")

from polyfuse.backends.triton.quant.gemm_gguf import gemm_gguf  # noqa: E402


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
GGUF = ["gguf_q8_0", "gguf_q4_0", "gguf_q4_1", "gguf_q4_k", "gguf_q5_k", "gguf_q6_k"]


def _on(qw, device):
    return dataclasses.replace(qw, qweight=qw.qweight.to(device))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", GGUF)
def test_gemm_against_the_reference(device, fmt):
    """Within 1e-5 of the largest output of the float64 product (float32 activations: the weights as the reference
    dequantizes them, the sums in float32), for 3 / 12 / 20 rows, N not a multiple of the tile, 1-3 splits of K (a
    split starting inside a super-block), bias, and SwiGLU's rows; a flipped scale byte moves it far past."""
    gen = torch.Generator().manual_seed(5)
    n, k = 40, 768
    wd = None
    for qw in (qf.quantize(fmt, torch.randn(n, k, generator=gen) * 0.05), random_gguf(fmt, n, k, seed=7)):
        qw = _on(qw, device)
        wd = qf.dequantize(qw, torch.float64)
        for m, tiles, split in ((3, None, None), (12, (16, 16, 64, 2, 1), 2), (20, (32, 32, 256, 4, 1), 3)):
            x, u = (torch.randn(m, k, generator=gen).to(device) for _ in range(2))
            bias = torch.randn(n, generator=gen).to(device)
            with torch.inference_mode():
                got = gemm_gguf(x, None, qw, bias, tiles=tiles, split=split)
                folded = gemm_gguf(x, u, qw, None, tiles=tiles, split=split)
            want = x.double() @ wd.t() + bias.double()
            assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (fmt, m, split)
            want = (torch.nn.functional.silu(x) * u).double() @ wd.t()
            assert (folded.double() - want).abs().max() <= 1e-5 * want.abs().max(), (fmt, m, split)
    nbytes = qf.GGUF_BYTES[fmt]
    raw = qw.qweight.view(n, -1, nbytes).clone()
    # every block's d (32-weight types: its high byte) or a K-quant's scale byte (Q4_K / Q5_K scale 0, Q6_K scale 0)
    raw[:, :, {"gguf_q4_k": 4, "gguf_q5_k": 4, "gguf_q6_k": 192}.get(fmt, 1)] ^= 0x21
    bad = dataclasses.replace(qw, qweight=raw.view(n, -1))
    want = x.double() @ qf.dequantize(bad, torch.float64).t() + bias.double()
    assert (got.double() - want).abs().max() > 1e-3 * want.abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_in_bfloat16(device):
    """bfloat16 activations and output (the GPU: a bfloat16 tensor-core product of the weights rounded as
    dequantize(qw, bfloat16) is; the CPU interpreter: float32): each output within two bfloat16 steps of the float32
    product with that weight (plus 1e-3 of the largest output for the sums' order)."""
    gen = torch.Generator().manual_seed(6)
    qw = _on(random_gguf("gguf_q4_k", 64, 512, seed=2), device)
    x = torch.randn(16, 512, generator=gen).to(torch.bfloat16).to(device)
    with torch.inference_mode():
        got = gemm_gguf(x, None, qw)
    want = x.float() @ qf.dequantize(qw, torch.bfloat16).float().t()
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).abs() <= 2**-7 * want.abs() + 1e-3 * want.abs().max()).all()
