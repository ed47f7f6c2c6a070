"""The opt-in W4A8 one-row int4 GEMV (the kernel option ``int4_a8``): int8 activations in blocks of 32 (polyfuse/ops/act_int8.py)
written by three kernels (backends/triton/quant/act_int8.py: a plain row, SwiGLU, add + RMSNorm), and the GEMV on integer
dot products (backends/triton/quant/gemv_int4_a8.py). The quantized bytes are compared with the torch reference bit for
bit, the GEMV with the float64 product of the dequantized weight and the dequantized activations, and a tiny int4
model's decode with the native model whose projections see the same quantized activations."""

import dataclasses

import pytest
import torch
from helpers import one_thread, record_last_logits_, tiny_config  # noqa: F401  (one_thread: autouse fixture)
from quant_cases import act_order, no_prefetch, quantized

from polyfuse.core import registry
from polyfuse.core.context import SelectionContext
from polyfuse.core.kernel_options import KernelOptions
from polyfuse.ops import quant_formats as qf
from polyfuse.ops.act_int8 import dequantize_act_int8, quantize_act_int8


pytest.importorskip("triton")

from polyfuse.backends.triton.quant import gemv_int4_a8 as a8  # noqa: E402
from polyfuse.backends.triton.quant.act_int8 import norm_quantize_row, quantize_row  # noqa: E402


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
ON = KernelOptions(int4_a8=True)


def words_of(q: torch.Tensor) -> torch.Tensor:
    """The reference layout: per 8 values, the even values' bytes then the odd ones', low byte first (int64)."""
    b = q.reshape(-1, 4, 2).to(torch.int64) & 0xFF
    shift = torch.tensor([0, 8, 16, 24], device=q.device)
    return torch.stack([(b[:, :, 0] << shift).sum(1), (b[:, :, 1] << shift).sum(1)], 1).reshape(-1)


def assert_quantized_as(xq, x):
    """(xw, dx, rs) from a kernel are quantize_act_int8(x), bit for bit."""
    xw, dx, rs = xq
    q, d = quantize_act_int8(x.reshape(-1))
    assert torch.equal(xw.to(torch.int64) & 0xFFFFFFFF, words_of(q))
    assert torch.equal(dx, d)
    assert torch.equal(rs, d * q.reshape(-1, 32).float().sum(1))


def test_reference_quantization_by_hand():
    """Scale amax / 127, values rounded half to even, zero and subnormal blocks all zeros with d = 0."""
    x = torch.zeros(96)
    x[:8] = torch.tensor([127.0, -63.5, 0.5, 1.5, 2.5, -127.0, 0.0, 64.5])
    x[64:] = 1e-40
    q, d = quantize_act_int8(x)
    assert q[:8].tolist() == [127, -64, 0, 2, 2, -127, 0, 64]  # -63.5 -> -64, 0.5 -> 0, 2.5 -> 2, 64.5 -> 64
    assert d.tolist() == [1.0, 0.0, 0.0] and not q[8:].any()
    y = torch.zeros(32)
    y[0], y[31] = 3.0, -1.0
    q, d = quantize_act_int8(y)
    assert q[0] == 127 and q[31] == -42 and not q[1:31].any() and d.item() == pytest.approx(3 / 127, rel=1e-7)
    assert dequantize_act_int8(q, d)[31].item() == pytest.approx(-42 * 3 / 127, rel=1e-6)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_act_int8(torch.ones(48))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_activation_kernels_write_the_reference_bytes(device, dtype):
    """The plain, SwiGLU and add + RMSNorm kernels: K over several programs and a partial last one, zero and
    subnormal blocks, large values; SwiGLU and the norm against the Triton SwiGLU / norm kernels' own outputs
    quantized by the reference (the same rounding of what those kernels store), the norm's residual sum too."""
    from polyfuse.backends.triton.rms_norm import rms_norm_forward
    from polyfuse.backends.triton.swiglu import swiglu_forward

    gen = torch.Generator().manual_seed(1)
    for k in (32, 2080) + ((8192,) if device == "cuda" else ()):  # 8192: the norm at 16 warps, as rms_norm.py
        x = (torch.randn(1, k, generator=gen) * 3).to(dtype)
        x[0, :32] = 0.0
        x[0, 32:64] = 1e-41 if dtype == torch.float32 else 0.0
        x[0, -5] = 300.0
        x = x.to(device)
        assert_quantized_as(quantize_row(x), x)
        g, u = ((torch.randn(1, k, generator=gen) * 2).to(dtype).to(device) for _ in range(2))
        assert_quantized_as(quantize_row(g, u), swiglu_forward(g, u))
        res = torch.randn(1, k, generator=gen).to(dtype).to(device)
        w = torch.rand(k, generator=gen).to(dtype).to(device)
        for r in (res, None):
            xw, dx, rs, total = norm_quantize_row(x, r, w, 1e-5)
            y, _, want = rms_norm_forward(x, w, 1e-5, r)
            assert_quantized_as((xw, dx, rs), y)
            assert torch.equal(total, want)


def reference(x, qw, bias=None):
    """float64: the dequantized activations times the dequantized weight."""
    q, d = quantize_act_int8(x.reshape(-1))
    out = dequantize_act_int8(q, d).double() @ qf.dequantize(qw).double().t()
    return out if bias is None else out + bias.double()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_gemv_against_the_reference(device, tmp_path):
    """Group sizes 32 / 64 / 128 / all of K, K split 1 to 5 ways (partial groups in a split), N not a multiple of
    the column block or a multiple (the unmasked loop), bias, tiles of 1..2 blocks of 32 along K, weights loaded before the PDL wait or not (the same bits):
    within 1e-5 of the largest output of the float64 reference (the integer dot products are exact; the zero-point
    term cancels a few bits of float32, as in gemv_int4.py). A zero point off by one moves it 100x past that."""
    late = no_prefetch(tmp_path)
    gen = torch.Generator().manual_seed(2)
    for n, k, g, tiles in ((40, 1056, 128, (16, 64, 1, 2)), (72, 512, 64, (32, 32, 2, 2)), (16, 384, 32, None),
                           (24, 288, 288, (8, 8, 1, 1)), (64, 512, 128, (32, 64, 1, 2))):  # fmt: skip
        qw = dataclasses.replace(qf.quantize("int4", torch.randn(n, k, generator=gen) * 0.05, group_size=g))
        qw = dataclasses.replace(
            qw, **{f: getattr(qw, f).to(device) for f in ("qweight", "qzeros", "scales", "g_idx")}
        )
        x = (torch.randn(1, k, generator=gen) + 0.5).to(device)
        bias = torch.randn(n, generator=gen).to(device)
        xq = quantize_row(x)
        want = reference(x, qw, bias)
        for split in (1, 2, 5):
            with torch.inference_mode():
                got = a8.gemv_int4_a8(xq, qw, torch.float32, bias, tiles=tiles, split=split)
                other = a8.gemv_int4_a8(xq, qw, torch.float32, bias, tiles=tiles, split=split, options=late)
            err = (got.double() - want).abs().max().item()
            assert err <= 1e-5 * want.abs().max().item(), (n, k, g, split, err)
            assert torch.equal(got, other), (n, k, split)
        # the bound sees a wrong zero point: the first group's zero of column 0 one higher
        bad = dataclasses.replace(qw, qzeros=qw.qzeros.clone())
        bad.qzeros[0, 0] = (bad.qzeros[0, 0] & ~15) | ((bad.qzeros[0, 0] + 1) & 15)
        assert (got.double() - reference(x, bad, bias)).abs().max().item() > 1e-3 * want.abs().max().item()


def test_accepts_and_the_dispatch(monkeypatch):
    """Off by default; with the option on, one-row int4 linear_q / swiglu_linear_q / add_rms_norm_linear_q (the gemv_q
    implementations) go through the W4A8 kernel and give its numbers; act-order, no group, groups or K not a multiple
    of 32 are declined to the bf16-activation GEMV."""
    from polyfuse.backends.triton.quant import gemv_q, norm_gemv_q

    qw = quantized("int4", 48, 256, "cpu")
    x = torch.randn(1, 256)
    assert not a8.accepts(x, qw)
    assert a8.accepts(x, qw, options=ON) and a8.accepts(x.bfloat16(), qw, options=ON)
    assert not a8.accepts(x, act_order(qw), options=ON)
    assert not a8.accepts(x, dataclasses.replace(qw, group_size=0), options=ON)
    assert not a8.accepts(x, dataclasses.replace(qw, group_size=16), options=ON)  # a group holds whole blocks of 32
    assert a8.accepts(x, dataclasses.replace(qw, group_size=256), options=ON)  # one group over K
    assert not a8.accepts(torch.randn(1, 264), quantized("int4", 48, 264, "cpu"), options=ON)  # K not a multiple of 32
    assert not a8.accepts(torch.randn(2, 256), qw, options=ON)  # one row only
    assert not a8.accepts(x, qw, up=torch.randn(1, 256).bfloat16(), options=ON)  # up of another dtype
    with pytest.raises(ValueError, match="one row"):
        quantize_row(torch.randn(2, 256))
    assert not a8.accepts(x, quantized("int8", 48, 256, "cpu"), options=ON)
    calls = []
    real = a8.gemv_int4_a8
    monkeypatch.setattr(a8, "gemv_int4_a8", lambda *a, **k: calls.append(1) or real(*a, **k))
    gate, up = torch.randn(1, 1, 256), torch.randn(1, 1, 256)
    weight, res = torch.rand(256), torch.randn(1, 1, 256)
    with torch.inference_mode():
        got = gemv_q.linear_q(x.view(1, 1, 256), qw, options=ON)
        assert torch.equal(got.view(1, -1), real(quantize_row(x), qw, x.dtype))
        from polyfuse.backends.triton.swiglu import swiglu_forward

        got = gemv_q.swiglu_linear_q(gate, up, qw, options=ON)
        assert torch.equal(got.view(1, -1), real(quantize_row(swiglu_forward(gate, up)), qw, x.dtype))
        out, total = norm_gemv_q.add_rms_norm_linear_q(x.view(1, 1, 256), res, weight, 1e-6, qw, options=ON)
        xw, dx, rs, r = norm_quantize_row(x, res.view(1, 256), weight, 1e-6)
        assert torch.equal(out.view(1, -1), real((xw, dx, rs), qw, x.dtype)) and torch.equal(total.view(1, -1), r)
    assert len(calls) == 3
    with torch.inference_mode():
        gemv_q.linear_q(x, act_order(qw), options=ON)
        gemv_q.linear_q(x, qw)  # the option off (its default)
    assert len(calls) == 3
    assert registry.bound("linear_q", "gemv_q")  # the implementation name the model binds below


@pytest.mark.slow
def test_tiny_model_decode_equals_the_native_model_on_the_same_int8_activations(tmp_path, monkeypatch):
    """Greedy decode of an int4 tiny Llama through the W4A8 path (the model's own ops: the norm + GEMV pair,
    SwiGLU + GEMV, the plain GEMV) against the native model whose int4 projections are given the same quantized
    activations (benchmarks/harness/act_int8.py, what evaluate_perplexity.py's int4+a8 scores): the same tokens, and each one-row
    step's logits within float32 rounding."""
    from benchmarks.harness.act_int8 import emulate_int8_activations_
    from polyfuse.models.llama import LlamaForCausalLM

    src = LlamaForCausalLM.from_config(tiny_config(num_key_value_heads=2), seed=3)
    src.save_pretrained(str(tmp_path))
    ids = torch.randint(10, 300, (1, 7), generator=torch.Generator().manual_seed(7))

    calls = []
    real = a8.gemv_int4_a8
    monkeypatch.setattr(a8, "gemv_int4_a8", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    runs = {}
    steps = {}
    for name in ("a8", "emulated"):
        model = LlamaForCausalLM.from_pretrained(str(tmp_path), quant="int4")
        if name == "a8":  # the model's kernels with the option on (a CPU run's own resolve picks no gemv_q)
            ctx = SelectionContext(torch.device("cpu"), flags={"int4_a8": True})
            for op in ("linear_q", "swiglu_linear_q", "add_rms_norm_linear_q"):
                setattr(model.kernels, op, registry.bound(op, "gemv_q", ctx))
        else:  # the native kernels (this CPU run's), every int4 projection fed int8 activations
            emulate_int8_activations_(model)
        steps[name] = record_last_logits_(model)
        runs[name] = model.generate(ids, max_new_tokens=5, ignore_eos=True)
    # 4 one-row steps x (q/k/v, o, gate/up, down) x 2 layers, all on W4A8, and the prompt's last layer past q/k/v:
    # o, gate/up and down on its last row only (models/decoder.py prune_last_layer)
    assert len(calls) == 4 * 4 * 2 + 3
    assert torch.equal(runs["a8"], runs["emulated"])
    for got, want in list(zip(steps["a8"], steps["emulated"]))[1:]:  # the one-row steps
        assert (got - want).abs().max() <= 2e-5 * want.abs().max()
