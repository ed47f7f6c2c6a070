"""fp8 projections on Gaudi (polyfuse/backends/hpu/fp8_linear.py, fp8_range.py) against the TEST DOUBLE of
habana_frameworks (tests/habana_double: ``torch.ops.hpu.cast_to_fp8_v2`` / ``fp8_gemm_v2`` / ``cast_from_fp8`` with
the device's fp8 range, Gaudi2 or Gaudi3 by ``HABANA_DOUBLE_DEVICE``). Nothing here has run on a Gaudi."""

import pytest
import torch
from test_hpu_backend import (  # noqa: F401
    HPU,
    _forget_habana,
    _import_double,
    _on_hpu_backend,
    needs_gaudi,
    no_default_device,
    no_habana,
)

from polyfuse.backends.hpu import fp8_linear
from polyfuse.backends.hpu.fp8_range import fit_gaudi2, halve_codes, rows_out_of_range
from polyfuse.core import registry
from polyfuse.core.registry import SelectionContext
from polyfuse.ops.quant_formats import FP8, QuantizedWeight, dequantize, quantize
from polyfuse.ops.quant_linear import linear_q_native


@pytest.fixture(params=["gaudi2", "gaudi3"])
def gaudi(monkeypatch, request):
    """The double imported as the Gaudi generation of the parameter; yields (double, generation)."""
    monkeypatch.setenv("HABANA_DOUBLE_DEVICE", request.param)
    double = _import_double(monkeypatch, None)
    import habana_frameworks.torch  # noqa: F401  (the double's hpu device)

    torch.set_default_device("hpu")  # the tensors below are HPU tensors, as on a Gaudi
    yield double, request.param
    no_default_device()
    _forget_habana()


def _host_randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), device="cpu")


def _weight(n=48, k=64, seed=0):
    return (_host_randn(n, k, seed=seed) * 0.05).to(torch.get_default_device())


def _rows(m=5, k=64, seed=1, dtype=torch.bfloat16):
    x = _host_randn(m, k, seed=seed)
    x[1, 7] = 9.0  # an outlier: its row's scale is set by it
    return x.to(dtype).to(torch.get_default_device())


def _fit(qw: QuantizedWeight) -> QuantizedWeight:
    """The runtime's adaptation, on copies (what finalize does to a loaded model)."""
    q = QuantizedWeight(qw.format, qw.shape, qw.qweight.clone(), qw.scales.clone(), group_size=qw.group_size)
    HPU_RUNTIME().adapt_quantized([q])
    return q


def HPU_RUNTIME():  # noqa: N802
    from polyfuse.backends.hpu.runtime import HpuRuntime

    return HpuRuntime(HPU)


def test_fp8_gemm_is_inc_arithmetic(gaudi):
    """The activations cast per token with the device's fullscale (240 on Gaudi2, 448 on Gaudi3) and INC's dynamic
    backoff (each row's largest value at half of it), then one fp8 GEMM with the per-token and per-channel scales,
    in INC's form (the weight as a [K, N] copy, trans_B=False): bit for bit what the same steps give by hand, and the recorded calls
    carry INC's argument order. (This checks the implementation against the double's reading of the ops; only the
    hardware test below checks the reading.)"""
    hf, gen = gaudi
    top = 240.0 if gen == "gaudi2" else 448.0
    assert fp8_linear.fullscale() == top
    qw = _fit(quantize("fp8", _weight()))
    x = _rows()
    hf.reset()
    y = fp8_linear.fp8_gemm(x, qw)
    scale = (x.float().abs().amax(-1, keepdim=True) / (top * 0.5)).clamp(min=torch.finfo(torch.bfloat16).tiny)
    x8 = (x.float() * (1.0 / scale)).clamp(-top, top).to(FP8)
    assert x8.float().abs().amax() == top * 0.5  # the outlier row's largest value
    expect = ((x8.float() * scale) @ (qw.qweight.float() * qw.scales[:, None]).t()).to(torch.bfloat16)
    torch.testing.assert_close(y, expect, rtol=0, atol=0)
    (cast,) = hf.calls("cast_to_fp8_v2")
    assert cast[0][2:5] == (False, False, FP8)
    torch.testing.assert_close(cast[0][1], (1.0 / scale).cpu())  # Habana's op is handed the device's buffers
    (gemm,) = hf.calls("fp8_gemm_v2")
    a, trans_a, b, trans_b, d, out_dtype, a_scale, b_scale, bias, acc, _ = gemm[0]
    assert (trans_a, trans_b, d, out_dtype, bias, acc) == (False, False, None, torch.bfloat16, None, False)
    assert b.shape == (64, 48) and b.is_contiguous() and torch.equal(b.cpu().float(), qw.qweight.cpu().float().t())
    assert a_scale.shape == (5, 1) and b_scale.shape == (48,)
    fp8_linear.fp8_gemm(x, qw)  # the copy is made once per weight
    assert hf.calls("fp8_gemm_v2")[1][0][2] is b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_near_the_weight_only_reference(gaudi, dtype):
    """W8A8 against the weight-only reference (dequantize + F.linear): off by the activations' e4m3 rounding only
    (a few percent of the outputs' rms), with a bias and a 3-D input."""
    qw = _fit(quantize("fp8", _weight(seed=2)))
    x = _rows(m=6, seed=3, dtype=dtype).view(2, 3, 64)
    bias = _host_randn(48, seed=4).to(dtype).to("hpu")
    y = fp8_linear.fp8_gemm(x, qw, bias)
    ref = linear_q_native(x, quantize("fp8", _weight(seed=2)), bias)
    assert y.shape == ref.shape == (2, 3, 48) and y.dtype == dtype
    err = (y.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()
    assert 1e-4 < err < 0.05, err  # not equal (the activations are quantized), not far


def test_gaudi2_halves_the_rows_beyond_its_range(gaudi):
    """A weight quantized for 448 holds codes Gaudi2 cannot read (the double makes them NaN, as the device's inf /
    NaN exponent would): the runtime halves those rows and doubles their scales, after which the output is the
    same weights' and the untouched rows keep their bytes. Gaudi3 changes nothing."""
    hf, gen = gaudi
    qw = quantize("fp8", _weight())  # every row's largest weight is 448: all rows beyond 240 ...
    assert rows_out_of_range(qw.qweight).all()
    fit_gaudi2(qw.qweight[::3], qw.scales[::3])  # ... but these, as a checkpoint quantized for 240 would have them
    hot = rows_out_of_range(qw.qweight)
    assert hot.any() and not hot.all()
    fitted = _fit(qw)
    if gen == "gaudi3":
        assert torch.equal(fitted.qweight.view(torch.uint8), qw.qweight.view(torch.uint8))
        return
    assert torch.isnan(fp8_linear.fp8_gemm(_rows(), qw)).all(dim=0)[hot].all()  # as stored: NaN columns
    assert not rows_out_of_range(fitted.qweight).any()
    assert torch.equal(fitted.qweight.view(torch.uint8)[~hot], qw.qweight.view(torch.uint8)[~hot])
    torch.testing.assert_close(fitted.scales[hot], qw.scales[hot] * 2, rtol=0, atol=0)
    torch.testing.assert_close(dequantize(fitted, torch.float32), dequantize(qw, torch.float32), rtol=0, atol=1e-9)
    y = fp8_linear.fp8_gemm(_rows(), fitted)
    assert torch.isfinite(y).all()


def test_halving_codes_is_exact_above_2_to_minus_5():
    """Every e4m3 code but NaN: halved codes equal torch's round-to-nearest-even of half the value, and are exact
    (twice them is the value) wherever the value is at least 2^-5."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)
    v = codes.float()
    ok = ~v.isnan()
    half = halve_codes(codes).float()
    assert torch.equal(half[ok], (v[ok] / 2).to(FP8).float())
    exact = ok & (v.abs() >= 2**-5)
    assert torch.equal(half[exact] * 2, v[exact])
    assert int((~exact & ok).sum()) > 0  # the rounded ones exist and were checked above


def test_fit_gaudi2_block_scales():
    """fp8_block: a row's every block scale doubles with it."""
    qw = quantize("fp8_block", _weight(k=256))
    before = dequantize(qw, torch.float32)
    rows = rows_out_of_range(qw.qweight)
    assert fit_gaudi2(qw.qweight, qw.scales) == int(rows.sum()) > 0
    torch.testing.assert_close(dequantize(qw, torch.float32), before, rtol=0, atol=1e-9)


def test_declines():
    qw = quantize("fp8", _weight())
    x = _rows()
    assert fp8_linear.accepts_linear_q(x, qw) is None
    assert "fp8_block" in fp8_linear.accepts_linear_q(x, quantize("fp8_block", _weight(k=128)))
    assert "int8" in fp8_linear.accepts_linear_q(x, quantize("int8", _weight()))
    assert "float16" in fp8_linear.accepts_linear_q(x.half(), qw)
    assert fp8_linear.accepts_linear_q(x.float().requires_grad_(), qw) == "needs gradients"


def test_registry_picks_habanas_fp8_gemm(gaudi):
    kernels = registry.resolve(SelectionContext(HPU, torch.bfloat16))
    choice = kernels.choices["linear_q"]
    assert (choice.implementation.backend, choice.implementation.name) == ("hpu", "fp8_gemm"), kernels.report()
    line = next(ln for ln in kernels.report().splitlines() if ln.strip().startswith("linear_q "))
    assert "hpu:fp8_gemm" in line and "declined inputs go to uint4_matmul, native" in line, line
    x = _rows()
    block = quantize("fp8_block", _weight(k=128))  # declined: the native reference runs it
    torch.testing.assert_close(kernels.linear_q(x[:, :1].expand(5, 128).contiguous(), block),
                               linear_q_native(x[:, :1].expand(5, 128).contiguous(), block))  # fmt: skip


@pytest.mark.usefixtures("no_habana")
def test_registry_without_habana():
    choice = registry.resolve(SelectionContext(HPU, torch.bfloat16)).choices["linear_q"]
    assert choice.implementation.name == "native"
    assert choice.reason == (
        "fallback: fp8_gemm: habana_frameworks.torch not importable; uint4_matmul: habana_frameworks.torch not importable"
    )


def test_registry_on_first_generation_gaudi(monkeypatch):
    monkeypatch.setenv("HABANA_DOUBLE_DEVICE", "gaudi")
    _import_double(monkeypatch, None)
    try:
        choice = registry.resolve(SelectionContext(HPU, torch.bfloat16)).choices["linear_q"]
        assert choice.implementation.name == "uint4_matmul"  # int4 still has Habana's kernel; fp8 the reference
        assert choice.reason == "best usable for hpu (skipped fp8_gemm)"
        assert ("fp8_gemm", "first-generation Gaudi has no fp8 GEMM") in choice.skipped
    finally:
        _forget_habana()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_model_runs_habanas_fp8_gemm(gaudi, dtype):
    """A tiny Llama quantized to fp8 on the HPU backend: every projection's call reaches fp8_gemm_v2 (q/k/v, o,
    gate/up and down per layer; the down projection through swiglu_linear_q's composite), finalize fits the weights
    to Gaudi2's range, and the logits stay near the weight-only reference model's (W8A8 against W8A16)."""
    from helpers import tiny_config

    from polyfuse.models.llama import LlamaForCausalLM
    from polyfuse.quant import qlinear
    from polyfuse.quant import quantize as q

    hf, gen = gaudi
    cfg = tiny_config()
    ref = LlamaForCausalLM.from_config(cfg, seed=3, dtype=dtype)
    q.quantize_model_(ref, "fp8")
    model = LlamaForCausalLM.from_config(cfg, seed=3, dtype=dtype)
    q.quantize_model_(model, "fp8")
    _on_hpu_backend(model, {})
    q.finalize(model)  # what loading does once the weights are in: the runtime fits them to the device
    qs = qlinear.quantized_modules(model)
    assert not any(rows_out_of_range(m.qweight).any() for m in qs.values()) or gen == "gaudi3"
    ids = torch.randint(10, 300, (2, 9), generator=torch.Generator().manual_seed(0), device="cpu")
    hf.reset()
    with torch.inference_mode():
        got = model(ids.to("hpu")).logits.float().cpu()
        want = ref(ids).logits.float()
    assert len(hf.calls("fp8_gemm_v2")) == len(qs) == 4 * cfg.num_hidden_layers
    assert torch.isfinite(got).all()
    err = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
    assert 1e-4 < err < 0.1, err  # the activations' e4m3 rounding over two layers (5% measured), not a wrong scale


@pytest.mark.hpu
@needs_gaudi
def test_fp8_gemm_on_a_gaudi():
    """On a real Gaudi (``make test-hpu``): a weight quantized for 448 on the host, moved to the device and fitted
    by the runtime (Gaudi2: rows halved on the device), through Habana's cast and fp8 GEMM, against the weight-only
    reference on the host."""
    import habana_frameworks.torch  # noqa: F401  (registers the hpu device)

    from polyfuse.backends.hpu._habana import clear_cache

    clear_cache()
    assert fp8_linear.missing_reason() is None
    host = quantize("fp8", _weight(n=256, k=512, seed=5))
    dev = QuantizedWeight("fp8", host.shape, host.qweight.to("hpu"), host.scales.to("hpu"))
    HPU_RUNTIME().adapt_quantized([dev])
    x = _rows(m=8, k=512, seed=6)
    y = fp8_linear.fp8_gemm(x.to("hpu"), dev).cpu().float()
    ref = linear_q_native(x, host).float()
    err = (y - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    assert err < 0.05, err


def test_loading_says_what_runs_fp8_on_hpu(gaudi, monkeypatch, caplog):
    """After loading fp8 weights on an HPU: nothing to say for per-channel fp8 in bfloat16 (Habana's fp8 GEMM runs
    it); one warning line for fp8_block weights and for a float16 run, which dequantize."""
    import logging
    from types import SimpleNamespace

    from polyfuse.quant import report as quant_report

    for fmt, dtype, want in (
        ("fp8", torch.bfloat16, []),
        ("fp8_block", torch.bfloat16, ["warning: fp8 weights on hpu: fp8_block weights (Habana's fp8 GEMM here takes "
                                       "per-channel fp8); they stay fp8 and every call dequantizes them"]),
        ("fp8", torch.float16, ["warning: fp8 weights on hpu, a float16 run: Habana's fp8 GEMM takes bfloat16 or "
                                "float32 activations; they stay fp8 and every call dequantizes them"]),
    ):  # fmt: skip
        monkeypatch.setattr(
            quant_report, "quantized_modules", lambda model, fmt=fmt: {"p": SimpleNamespace(format=fmt)}
        )
        kernels = registry.resolve(SelectionContext(HPU, dtype))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            quant_report.warn_unaccelerated(SimpleNamespace(kernels=kernels, dtype=dtype))
        assert [r.getMessage() for r in caplog.records] == want


def test_weights_quantized_on_a_gaudi2_fit_its_range(gaudi, monkeypatch):
    """Quantizing on the device (--quant fp8 at load, random weights, quantize_model_) scales fp8 to the device's
    range: 240 on Gaudi2, as INC does (Gaudi2 cannot hold the larger codes, so halving afterwards could not repair
    them), 448 elsewhere; the weights are the same up to e4m3's rounding either way."""
    from polyfuse.quant import qlinear
    from polyfuse.quant import quantize as q
    from polyfuse.quant.quantize import device_quantizer

    hf, gen = gaudi
    top = 240.0 if gen == "gaudi2" else 448.0
    from polyfuse.backends.hpu.runtime import HpuRuntime

    assert HpuRuntime.fp8_max() == (240.0 if gen == "gaudi2" else None)
    w = _weight(k=256)
    for fmt in ("fp8", "fp8_block"):
        parts = device_quantizer(HPU)(fmt, w)
        assert parts["qweight"].float().abs().amax() == top, fmt
        assert not rows_out_of_range(parts["qweight"]).any() or gen == "gaudi3"
        qw = QuantizedWeight(fmt, tuple(w.shape), group_size=128 if fmt == "fp8_block" else 0, **parts)
        err = (dequantize(qw, torch.float32) - w).abs().max() / w.abs().max()
        assert err < 2**-4, (fmt, err)
    # the model paths quantize through it: a quantizer on the CPU tensors the double works on, told it is a Gaudi's
    monkeypatch.setattr(q, "device_quantizer", lambda device, real=q.device_quantizer: real(HPU))
    from helpers import tiny_config

    from polyfuse.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_config(tiny_config(), seed=1, quant="fp8")
    codes = [m.qweight.float().abs().amax() for m in qlinear.quantized_modules(model).values()]
    assert codes and all(c == top for c in codes), codes
    model = LlamaForCausalLM.from_config(tiny_config(), seed=1)
    q.quantize_model_(model, "fp8")
    q.quantize_lm_head_(model, "fp8")
    codes = [m.qweight.float().abs().amax() for m in qlinear.quantized_modules(model).values()]
    assert len(codes) == 4 * 2 + 1 and all(c == top for c in codes), codes
