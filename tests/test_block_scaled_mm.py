"""fp8_block prefill on the tensor cores (backends/triton/quant/fp8_block_mm.py): activations quantized per token and 128
columns, then torch._scaled_mm with 1 x 128 block scales on both operands.

CPU: the group quantization's bytes and scales against torch's arithmetic, the scale layout cuBLAS reads, where the
implementation sits in the NVIDIA chain and what declines it. GPU (``-m cuda``, Hopper): the product against the
same arithmetic in float32 and against the weight-only reference, with and without padded rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import one_thread  # noqa: F401  (autouse fixture)
from quant_cases import quantized

from polyfuse.core import registry
from polyfuse.core.context import SelectionContext
from polyfuse.core.platform import Platform
from polyfuse.ops.quant_formats import dequantize


def _groups_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    g = x.float().view(m, k // 128, 128)
    amax = g.abs().amax(-1).clamp_min(1e-12)
    inv = torch.full_like(amax, 448.0) / amax  # an IEEE division (a python 448.0 / tensor multiplies a reciprocal)
    q = (g * inv[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(m, k), amax / 448.0


def test_groups_quantize_as_torch_does_with_the_layout_cublas_reads():
    from polyfuse.backends.triton.quant.fp8_block_mm import quantize_groups

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(21, 384, generator=gen) * 2).bfloat16()
    x[2] = 0  # a zero row: scale 1e-12 / 448, codes 0
    x[4, 5] = 3e3  # an outlier: only its own group is coarsened
    x[7, 128:256] = (torch.randn(128, generator=gen) * 1e-4).bfloat16()
    q, s = quantize_groups(x)
    q_ref, s_ref = _groups_reference(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    assert s.shape == (21, 3) and s.stride() == (1, 21)  # [M, K / 128], M-major
    assert s[4, 0] > 10 * s[4, 1]  # the outlier's group only


def _h200(monkeypatch, cuda="13.0", capability=(9, 0), dtype=torch.bfloat16, version="2.11.0"):
    monkeypatch.setattr(torch.version, "cuda", cuda)  # the probe reads the runtime's versions
    monkeypatch.setattr(torch, "__version__", version)
    return SelectionContext(torch.device("cuda"), dtype, platform=Platform("cuda", "cuda", "NVIDIA H200", capability))


def test_its_place_in_the_nvidia_chain(monkeypatch):
    names = [i.name for i in registry.select("linear_q", _h200(monkeypatch)).then]
    assert names.index("gemm_q") < names.index("fp8_block_mm") < names.index("dequant_mm")
    for kw, why in (
        ({"capability": (8, 9)}, "compute capability 9.0 (this: compute capability 8.9)"),
        ({"cuda": "12.4"}, "CUDA >= 12.9"),
        ({"version": "2.7.1+cu126"}, "torch >= 2.9"),
        ({"dtype": torch.float16}, "needs bfloat16 (run is float16)"),
    ):
        ctx = _h200(monkeypatch, **kw)
        choice = registry.select("linear_q", ctx)
        assert "fp8_block_mm" not in [i.name for i in choice.then]
        impl = next(i for i in registry.implementations("linear_q") if i.name == "fp8_block_mm")
        assert why in impl.unusable_reason(ctx)


def test_what_it_declines():
    from polyfuse.backends.triton.quant.fp8_block_mm import accepts_linear_q

    qb, qc = quantized("fp8_block", 48, 256, "cpu"), quantized("fp8", 48, 256, "cpu")
    x = torch.randn(2, 40, 256).bfloat16()
    assert accepts_linear_q(x, qb) == "cuBLAS block-scaled fp8: a CUDA GPU"  # the last check: all others pass
    assert "takes fp8_block" in accepts_linear_q(x, qc)
    assert "bfloat16" in accepts_linear_q(x.float(), qb)
    assert "multiple of 128" in accepts_linear_q(
        torch.randn(2, 40, 200).bfloat16(), dataclasses.replace(qb, shape=(48, 200))
    )
    assert "multiple of 128" in accepts_linear_q(x, dataclasses.replace(qb, shape=(40, 256)))  # N = 40
    with torch.enable_grad():
        assert "gradients" in accepts_linear_q(x.requires_grad_(), qb)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [2048, 130, 65, 16, 2])
def test_block_product_on_the_gpu(rows):
    """Against the same arithmetic in float32 (the e4m3 groups dequantized times the dequantized weight): the bf16
    output's rounding (on an H200: rms 0.17% of the outputs' rms, largest 1.5-1.9%); against the weight-only
    reference: the activations' e4m3 rounding (2.0%). 130, 65 and 2 rows take the padded path (cuBLAS wants a
    multiple of 4); a scale read from the wrong group or block is off by the outliers' 40x."""
    from polyfuse.backends.triton.register import probe_block_scaled_mm
    from polyfuse.core.platform import detect_platform

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    why = probe_block_scaled_mm(
        SelectionContext(torch.device("cuda"), torch.bfloat16, platform=detect_platform("cuda"))
    )
    if why:
        pytest.skip(why)
    from polyfuse.backends.triton.quant.fp8_block_mm import accepts_linear_q, linear_q

    gen = torch.Generator().manual_seed(rows)
    qw = quantized("fp8_block", 1024, 4096, "cuda")
    x = (torch.randn(rows, 4096, generator=gen) * 2).bfloat16().cuda()
    x[:, :4] *= 40  # outlier channels
    bias = torch.randn(1024, generator=gen).bfloat16().cuda()
    assert accepts_linear_q(x, qw) is None
    y = linear_q(x, qw, bias).float()
    q, s = _groups_reference(x)
    xd = (q.float().view(rows, 32, 128) * s[..., None]).view(rows, 4096)
    w = dequantize(qw).float()
    same = F.linear(xd, w, bias.float())
    weight_only = F.linear(x.float(), w, bias.float())
    rms = weight_only.pow(2).mean().sqrt()
    assert (y - same).pow(2).mean().sqrt() <= 4e-3 * rms, ((y - same).pow(2).mean().sqrt(), rms)
    assert (y - same).abs().max() <= 0.03 * rms, ((y - same).abs().max(), rms)
    assert (y - weight_only).pow(2).mean().sqrt() <= 0.04 * rms
