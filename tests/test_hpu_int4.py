"""int4 projections on Gaudi (polyfuse/backends/hpu/int4_linear.py) against the TEST DOUBLE of habana_frameworks
(tests/habana_double: ``torch.ops.hpu.convert_from_uint4`` as the bridge's hpu_ops/int4_ops.cpp declares and checks
it). Nothing here has run on a Gaudi."""

import dataclasses
import logging

import pytest
import torch
from quant_cases import act_order
from test_hpu_backend import HPU, _forget_habana, _import_double, _on_hpu_backend, needs_gaudi, no_default_device  # noqa: F401

from polyfuse.backends.hpu import int4_linear
from polyfuse.core import registry
from polyfuse.core.registry import Planned, SelectionContext
from polyfuse.ops.quant_formats import QuantizedWeight, dequantize, quantize
from polyfuse.ops.quant_linear import linear_q_native


@pytest.fixture
def hf(monkeypatch):
    """The double, with its bridge imported (what registers torch.ops.hpu's ops, as the real one does)."""
    double = _import_double(monkeypatch, None)
    import habana_frameworks.torch  # noqa: F401

    torch.set_default_device("hpu")  # the tensors below are HPU tensors, as on a Gaudi
    yield double
    no_default_device()
    _forget_habana()


def _host(fn, *args, seed, **kw):
    return fn(*args, generator=torch.Generator().manual_seed(seed), device="cpu", **kw).to(torch.get_default_device())


def _weight(n=48, k=256, seed=0):
    return _host(torch.randn, n, k, seed=seed) * 0.05


def _rows(m=5, k=256, seed=1, dtype=torch.float32):
    return _host(torch.randn, m, k, seed=seed).to(dtype)


def _err(a, b):
    return float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt())


def test_double_reads_habanas_layout(hf):
    """The double's convert_from_uint4: value j of word c (low bits first) is column 8 c + j, a [G, N] scale covers
    blocks of K / G rows, a zero point packed like the input or unpacked in the scale's dtype, and the bridge's
    refusals (non-int32 input, a scale that does not divide the output)."""
    q = _host(torch.randint, 0, 16, (4, 16), seed=0, dtype=torch.int32)
    words = int4_linear.pack_rows(q)
    assert words.shape == (4, 2) and words.dtype == torch.int32
    assert int(words[1, 1]) & 15 == int(q[1, 8]) and (int(words[1, 1]) >> 28) & 15 == int(q[1, 15])
    scale = torch.tensor([[0.5] * 16, [2.0] * 16])  # rows 0-1, rows 2-3
    zeros = torch.full((2, 16), 3, dtype=torch.int32)
    zeros[1, 5] = 9
    want = (q - zeros.repeat_interleave(2, 0)).float() * scale.repeat_interleave(2, 0)
    packed_zp = int4_linear.pack_rows(zeros)
    for zp in (packed_zp, zeros.float()):
        got = torch.ops.hpu.convert_from_uint4(words, scale, zp, torch.float32)
        assert torch.equal(got, want)
    with pytest.raises(Exception, match="int input"):
        torch.ops.hpu.convert_from_uint4(words.float(), scale, None, torch.float32)
    with pytest.raises(Exception, match="divides"):
        torch.ops.hpu.convert_from_uint4(words, torch.ones(3, 16), None, torch.float32)
    with pytest.raises(Exception, match="zero_point dtype"):
        torch.ops.hpu.convert_from_uint4(words, scale, zeros.half(), torch.float32)


def _bf16_scales(qw):
    """``qw`` with its float16 scales rounded to bfloat16, the scales Habana's call gets (INC's dtype)."""
    return dataclasses.replace(qw, scales=qw.scales.to(torch.bfloat16).half())


@pytest.mark.parametrize("acts", ["in_order", "act_order"])
def test_uint4_matmul_is_the_reference_with_bf16_scales(hf, acts):
    """bfloat16 activations, INC's form of the call: Habana's packing of the weight (int32 [K, N / 8]) and of the
    true zero points (int32 [G, N / 8]), the scales in bfloat16 (each float16 scale within 2^-9), bfloat16 output.
    The dequantized weight is bit for bit the reference's with those scales; the output (3-D, with a bias) is the
    reference's within bf16 rounding; act-order weights run with their rows sorted by group and the activations
    gathered to match."""
    qw = quantize("int4", _weight())
    if acts == "act_order":
        with torch.device("cpu"):
            qw = act_order(qw)
    x = _rows(m=6, dtype=torch.bfloat16).view(2, 3, 256)
    bias = _host(torch.randn, 48, seed=4).to(torch.bfloat16)
    hf.reset()
    y = int4_linear.uint4_matmul(x, qw, bias)
    ref = linear_q_native(x.float(), _bf16_scales(qw), bias.float())
    assert y.shape == ref.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    assert _err(y, ref) < 1e-2, _err(y, ref)
    ((args, _),) = hf.calls("convert_from_uint4")
    words, scales, zeros, dtype = args
    assert words.shape == (256, 6) and words.dtype == zeros.dtype == torch.int32 and dtype == torch.bfloat16
    assert zeros.shape == (2, 6) and scales.shape == (2, 48) and scales.dtype == torch.bfloat16
    packed = int4_linear.prepare(qw)
    assert (packed.perm is None) == (acts == "in_order")
    w = torch.ops.hpu.convert_from_uint4(words.to("hpu"), scales.to("hpu"), zeros.to("hpu"), torch.bfloat16)
    want = dequantize(_bf16_scales(qw), torch.bfloat16).t()
    assert torch.equal(w, want if packed.perm is None else want[packed.perm])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conformance_cases_through_the_hpu_chain(hf, dtype, caplog):
    """The conformance suite's linear_q cases (tests/quant_cases.py) of every format but fp8 (W8A8 on Gaudi, tested
    in test_hpu_fp8.py), through the HPU backend's chain: in bfloat16, int4 with whole groups (in order and
    act-order) runs Habana's dequantization, the rest (partial groups, int8, GGUF) the reference; in float32
    everything runs the reference. All within the bf16 scales' rounding of the reference (float32: equal), and no
    decline but the partial groups' warns."""
    from quant_cases import cases_linear_q

    kernels = registry.resolve(SelectionContext(HPU, dtype))
    hf.reset()
    registry._warned.clear()
    ran = 0
    with caplog.at_level(logging.WARNING):
        with torch.device("cpu"):  # the cases draw on the host from seeded generators, then move to the HPU
            cases = cases_linear_q(torch.device("hpu"), dtype, big=False)
        for name, make in cases:
            if name.startswith("fp8"):
                continue
            args, kwargs, _ = make()
            got = kernels.linear_q(*args, **kwargs)
            want = linear_q_native(*args, **kwargs)
            assert got.shape == want.shape and got.dtype == want.dtype, name
            assert _err(got, want) < (1e-6 if dtype == torch.float32 else 1e-2), name
            ran += 1
    assert ran > 20
    # int4 and int4_act at K = 256, the only whole groups: bfloat16 only
    assert len(hf.calls("convert_from_uint4")) == (2 if dtype == torch.bfloat16 else 0)
    msgs = [r.getMessage() for r in caplog.records]
    partial = [m for m in msgs if "uint4_matmul cannot take this input (a last partial group" in m]
    assert len(partial) == len(msgs) == (2 if dtype == torch.bfloat16 else 0), msgs  # K = 288 and 96, once each


def _zero_16(qw):
    """``qw`` with one stored zero nibble 15 (a zero point of 16, which polyfuse's reference reads as 16)."""
    qz = qw.qzeros.clone()
    qz[0, 0] = (qz[0, 0] & ~15) | 15
    return dataclasses.replace(qw, qzeros=qz)


def test_declines(hf, caplog):
    """Another format's weight, or activations other than bfloat16, are not its calls (Planned: no warning; the
    loader's line covers the dtype); a last partial group, a zero point of 16 and calls that need gradients go to
    the reference with one warning each, naming what runs."""
    qw = quantize("int4", _weight())
    x = _rows(dtype=torch.bfloat16)
    assert int4_linear.accepts_linear_q(x, qw) is None
    for other, what in ((x, quantize("int8", _weight())), (x.float(), qw), (x.half(), qw)):
        why = int4_linear.accepts_linear_q(other, what)
        assert isinstance(why, Planned), why
    assert int4_linear.accepts_linear_q(x.float().requires_grad_().bfloat16(), qw) == "needs gradients"
    partial = quantize("int4", _weight(k=200))
    xp = _rows(k=200, dtype=torch.bfloat16)
    assert "partial group" in int4_linear.accepts_linear_q(xp, partial)
    z16 = _zero_16(quantize("int4", _weight(seed=9)))
    assert "zero point of 16" in int4_linear.accepts_linear_q(x, z16)
    kernels = registry.resolve(SelectionContext(HPU, torch.bfloat16))
    registry._warned.clear()
    with caplog.at_level(logging.WARNING):
        for w, xs in ((partial, xp), (z16, x), (quantize("int8", _weight()), x)):
            torch.testing.assert_close(kernels.linear_q(xs, w), linear_q_native(xs, w))
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "uint4_matmul cannot take this input (a last partial group" in msgs[0] and msgs[0].endswith("; native runs")
    assert "zero point of 16" in msgs[1] and msgs[1].endswith("; native runs")


def test_fp8_declines_name_what_runs(hf, caplog):
    """fp8_gemm declining an fp8_block weight or float16 activations: the warning names the reference, which runs
    them, not uint4_matmul, the next link, which passes fp8 weights on."""
    kernels = registry.resolve(SelectionContext(HPU, torch.bfloat16))
    registry._warned.clear()
    block = quantize("fp8_block", _weight(k=128))
    x = _rows(k=128, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        torch.testing.assert_close(kernels.linear_q(x, block), linear_q_native(x, block))
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "fp8_gemm cannot take this input (fp8_block weights" in msg and msg.endswith("; native runs"), msg


def test_repacked_again_when_the_buffer_changes(hf):
    """The Habana copy follows its buffers: a weight changed in place (its version counter moves) is repacked, and
    scales changed in place (scale tuning) are cast again, so the output is the new weight's, not the cached one's;
    unchanged buffers reuse the copy."""
    qw = quantize("int4", _weight(seed=5))
    x = _rows(seed=6, dtype=torch.bfloat16)
    first = int4_linear.uint4_matmul(x, qw)
    packed = int4_linear.prepare(qw)
    assert int4_linear.prepare(qw) is packed
    other = quantize("int4", _weight(seed=7))
    qw.qweight.copy_(other.qweight)
    got = int4_linear.uint4_matmul(x, qw)
    assert int4_linear.prepare(qw) is not packed
    assert _err(got, linear_q_native(x.float(), _bf16_scales(qw))) < 1e-2 and _err(got, first) > 0.1
    qw.scales.mul_(2)
    torch.testing.assert_close(int4_linear.uint4_matmul(x, qw).float(), got.float() * 2, rtol=1e-2, atol=1e-2)


def test_registry_chain_on_hpu(hf):
    """linear_q on an HPU: Habana's fp8 GEMM, then its 4-bit dequantization, then the reference; the report says
    so."""
    kernels = registry.resolve(SelectionContext(HPU, torch.bfloat16))
    c = kernels.choices["linear_q"]
    assert [i.name for i in (c.implementation, *c.then)] == ["fp8_gemm", "uint4_matmul"], kernels.report()
    line = next(ln for ln in kernels.report().splitlines() if ln.strip().startswith("linear_q "))
    assert "declined inputs go to uint4_matmul, native" in line, line


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_model_runs_habanas_dequantization(hf, dtype):
    """A tiny Llama quantized to int4 on the HPU backend. bfloat16: finalize repacks every weight once, each
    projection's call reaches convert_from_uint4 (q/k/v, o, gate/up and down per layer) on those same copies, and
    the logits are the CPU reference model's within the scales' bf16 rounding and bf16 matmuls. float32: no copy is
    made (the kernel takes bfloat16 only) and every call runs the reference."""
    from helpers import tiny_config

    from polyfuse.models.llama import LlamaForCausalLM
    from polyfuse.quant import qlinear
    from polyfuse.quant import quantize as q

    cfg = tiny_config(hidden_size=128, intermediate_size=256)  # whole groups of 128 in every projection
    ref = LlamaForCausalLM.from_config(cfg, seed=3, dtype=dtype)
    q.quantize_model_(ref, "int4")
    model = LlamaForCausalLM.from_config(cfg, seed=3, dtype=dtype)
    q.quantize_model_(model, "int4")
    _on_hpu_backend(model, {})
    q.finalize(model)
    qs = qlinear.quantized_modules(model)
    copies = [int4_linear._PACKED.get(m.qweight) for m in qs.values()]
    bf16 = dtype == torch.bfloat16
    assert all((c is not None) == bf16 for c in copies)
    ids = torch.randint(10, 300, (2, 9), generator=torch.Generator().manual_seed(0), device="cpu")
    hf.reset()
    with torch.inference_mode():
        got = model(ids.to("hpu")).logits.float().cpu()
        want = ref(ids).logits.float()
    assert len(hf.calls("convert_from_uint4")) == (len(qs) if bf16 else 0) and len(qs) == 4 * cfg.num_hidden_layers
    assert [int4_linear._PACKED.get(m.qweight) for m in qs.values()] == copies  # the same objects: none remade
    assert _err(got, want) < (0.03 if bf16 else 1e-6)


def test_loading_says_what_no_habana_kernel_takes(hf, monkeypatch, caplog):
    """After loading on an HPU: int4 in bfloat16 says nothing (Habana's kernel runs it); int8 and a GGUF type kept
    as stored, or int4 in a float32 or float16 run, get one warning line naming what runs."""
    from types import SimpleNamespace

    from polyfuse.quant import report as quant_report

    for fmts, dtype, want in (
        (("int4",), torch.bfloat16, []),
        (("int4",), torch.float32,
         ["warning: int4 weights on hpu, a float32 run: no Habana kernel takes them here; they stay packed and every "
          "call dequantizes them (dequantize + F.linear)"]),
        (("int8", "gguf_q4_1", "int4"), torch.bfloat16,
         ["warning: gguf_q4_1, int8 weights on hpu, a bfloat16 run: no Habana kernel takes them here; they stay "
          "packed and every call dequantizes them (dequantize + F.linear)"]),
        (("int4",), torch.float16,
         ["warning: int4 weights on hpu, a float16 run: no Habana kernel takes them here; they stay packed and every "
          "call dequantizes them (dequantize + F.linear)"]),
    ):  # fmt: skip
        mods = {str(i): SimpleNamespace(format=f) for i, f in enumerate(fmts)}
        monkeypatch.setattr(quant_report, "quantized_modules", lambda model, mods=mods: mods)
        kernels = registry.resolve(SelectionContext(HPU, dtype))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            quant_report.warn_unaccelerated(SimpleNamespace(kernels=kernels, dtype=dtype))
        assert [r.getMessage() for r in caplog.records] == want


@pytest.mark.hpu
@needs_gaudi
def test_uint4_matmul_on_a_gaudi():
    """On a real Gaudi (``make test-hpu``): an int4 weight quantized on the host, in order and act-order, moved to
    the device, through Habana's convert_from_uint4 and matmul, against the reference on the host."""
    import habana_frameworks.torch  # noqa: F401  (registers the hpu device)

    from polyfuse.backends.hpu._habana import clear_cache

    clear_cache()
    assert int4_linear.missing_reason() is None
    for host in (quantize("int4", _weight(n=256, k=512, seed=8)), act_order(quantize("int4", _weight(256, 512, 8)))):
        dev = QuantizedWeight("int4", host.shape, host.qweight.to("hpu"), host.scales.to("hpu"),
                              host.qzeros.to("hpu"), host.g_idx.to("hpu"), host.group_size, host.act_order)  # fmt: skip
        x = _rows(m=8, k=512, seed=9, dtype=torch.bfloat16)
        y = int4_linear.uint4_matmul(x.to("hpu"), dev).cpu().float()
        assert _err(y, linear_q_native(x.float(), host)) < 1e-2
