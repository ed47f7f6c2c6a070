"""The GGUF one-row GEMV on int8 activations (the kernel option ``gguf_a8``, on by default): the activations quantized in blocks of 32 in natural
order (backends/triton/quant/act_int8.py ``natural``), the GEMV on integer dot products (backends/triton/quant/gemv_gguf_a8.py:
Q8_0 / Q4_0 / Q4_1; gemv_gguf_kquant_a8.py: Q4_K / Q5_K / Q6_K). Bytes against the torch reference bit for bit, the GEMV against the float64
product of the dequantized weight and activations, a tiny GGUF model's decode against the native model fed the same
activations."""

import dataclasses

import pytest
import torch
from helpers import one_thread, record_last_logits_, tiny_config, write_tiny_gguf  # noqa: F401  (one_thread: autouse)
from quant_cases import random_gguf, tile_options

from polyfuse.core import registry
from polyfuse.core.context import SelectionContext
from polyfuse.core.kernel_options import KernelOptions
from polyfuse.ops import quant_formats as qf
from polyfuse.ops.act_int8 import dequantize_act_int8, quantize_act_int8


pytest.importorskip("triton")

from polyfuse.backends.triton.quant import gemv_gguf_a8 as ga8  # noqa: E402
from polyfuse.backends.triton.quant.act_int8 import norm_quantize_row, quantize_row, quantize_rows  # noqa: E402


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
OFF = KernelOptions(gguf_a8=False)


def natural_words(q: torch.Tensor) -> torch.Tensor:
    """Values 4i .. 4i + 3's bytes in word i, low byte first (int64)."""
    b = q.reshape(-1, 4).to(torch.int64) & 0xFF
    return (b << torch.tensor([0, 8, 16, 24], device=q.device)).sum(1)


def assert_quantized_as(xq, x):
    xw, dx, rs = xq
    q, d = quantize_act_int8(x.reshape(-1))
    assert torch.equal(xw.to(torch.int64) & 0xFFFFFFFF, natural_words(q))
    assert torch.equal(dx, d)
    assert torch.equal(rs, d * q.reshape(-1, 32).float().sum(1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_kernels_write_natural_order(device, dtype):
    """The plain, SwiGLU and add + RMSNorm kernels with ``natural``: the reference's bytes in the values' order."""
    from polyfuse.backends.triton.rms_norm import rms_norm_forward
    from polyfuse.backends.triton.swiglu import swiglu_forward

    gen = torch.Generator().manual_seed(1)
    for k in (256, 2304):
        x = (torch.randn(1, k, generator=gen) * 3).to(dtype)
        x[0, :32] = 0.0
        x[0, -7] = 250.0
        x = x.to(device)
        assert_quantized_as(quantize_row(x, natural=True), x)
        g, u = ((torch.randn(1, k, generator=gen) * 2).to(dtype).to(device) for _ in range(2))
        assert_quantized_as(quantize_row(g, u, natural=True), swiglu_forward(g, u))
        res = torch.randn(1, k, generator=gen).to(dtype).to(device)
        w = torch.rand(k, generator=gen).to(dtype).to(device)
        xw, dx, rs, total = norm_quantize_row(x, res, w, 1e-5, natural=True)
        y, _, want = rms_norm_forward(x, w, 1e-5, res)
        assert_quantized_as((xw, dx, rs), y)
        assert torch.equal(total, want)


def reference(x, qw, bias=None):
    q, d = quantize_act_int8(x.reshape(-1))
    out = dequantize_act_int8(q, d).double() @ qf.dequantize(qw).double().t()
    return out if bias is None else out + bias.double()


def _on(qw, device):
    return dataclasses.replace(qw, qweight=qw.qweight.to(device))


GGUF = ["gguf_q8_0", "gguf_q4_0", "gguf_q4_1", "gguf_q4_k", "gguf_q5_k", "gguf_q6_k"]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", GGUF)
def test_gemv_against_the_reference(device, fmt):
    """Our packing and (super-)blocks of random bytes (every quant pattern, every K-quant scale / min / high-bit
    pattern, negative and zero d, Q6_K's negative scales), N not a multiple of the row block, 1..5 splits, several
    blocks a step, an odd number of super-blocks per row (Q6_K's 210-byte super-blocks then start off 4-byte
    boundaries; Q8_0 / Q4_0 read their blocks by pairs: a split may start on either of a pair), bias: within 1e-5 of
    the largest output of the float64 reference. Q4_1's and Q4_K's mins, Q5_K's fifth bits, Q6_K's high bits and the
    second block of a Q8_0 / Q4_0 pair are seen: a wrong one moves it far past."""
    gen = torch.Generator().manual_seed(2)
    if fmt in qf.K_QUANTS:
        # Q6_K reads an even number of super-blocks per row by pairs of 32-bit words: (7, 1536) one a step, 2 splits
        # of 3, the second starting on a pair's second super-block
        cases = ((40, 768, None), (9, 1280, (4, 512, 1, 2)), (64, 512, (8, 256, 2, 2)), (7, 1536, (2, 256, 1, 1)))
    else:
        # one block a step: 2 splits of 5 blocks, the second starting on a pair's second block
        cases = ((40, 768, None), (9, 1344, (4, 128, 1, 2)), (33, 576, (8, 64, 2, 2)), (7, 320, (2, 32, 1, 1)))
    for n, k, tiles in cases:
        for qw in (qf.quantize(fmt, torch.randn(n, k, generator=gen) * 0.05), random_gguf(fmt, n, k, seed=n)):
            qw = _on(qw, device)
            x = (torch.randn(1, k, generator=gen) + 0.3).to(device)
            bias = torch.randn(n, generator=gen).to(device)
            xq = quantize_row(x, natural=True)
            want = reference(x, qw, bias)
            for split in (1, 2, 5):
                with torch.inference_mode():
                    got = ga8.gemv_gguf_a8(xq, qw, torch.float32, bias, tiles=tiles, split=split)
                err = (got.double() - want).abs().max().item()
                assert err <= 1e-5 * want.abs().max().item(), (n, k, split, err)
    nbytes = qf.GGUF_BYTES[fmt]
    raw = qw.qweight.view(n, -1, nbytes).clone()
    # Q4_K: scale and min of sub-block 0; Q5_K's fifth bits, Q6_K's high bits; Q4_1's m; the pair's second block's
    # last quant byte (Q8_0 / Q4_0)
    at = {"gguf_q4_k": 4, "gguf_q5_k": 16, "gguf_q6_k": 128, "gguf_q4_1": 3}.get(fmt, 2 * nbytes - 1)
    raw.view(n, -1)[:, torch.arange(at, raw.numel() // n, 2 * nbytes if at >= nbytes else nbytes)] ^= 0x21
    bad = dataclasses.replace(qw, qweight=raw.view(n, -1))
    assert (got.double() - reference(x, bad, bias)).abs().max().item() > 1e-3 * want.abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", GGUF)
def test_rows_against_the_reference(device, fmt):
    """Several activation rows (batch decode): rows of a wider tensor (a row stride past K), SwiGLU's rows, 2 / 5 / 8
    rows in one launch, 9 and 11 in two (8 + 1, 8 + 3); each row's quantized bytes are the reference's (plain rows)
    and the one-row kernel's, and each output row is within 1e-5 of the largest output of the float64 reference of
    that row. Q6_K with an even number of super-blocks per row (its word-pair reads). A launch that drops its last
    row or mixes rows up fails."""
    gen = torch.Generator().manual_seed(3)
    k = {"gguf_q6_k": 1536, "gguf_q4_k": 768, "gguf_q5_k": 768}.get(fmt, 320)
    qw = _on(random_gguf(fmt, 37, k, seed=4), device)
    bias = torch.randn(37, generator=gen).to(device)
    wide = (torch.randn(11, k + 40, generator=gen) + 0.2).to(device)
    gate, up = ((torch.randn(5, k, generator=gen) * 2).to(device) for _ in range(2))
    for x, u in ((wide[:2, :k], None), (wide[:5, 3 : k + 3], None), (wide[:8, :k], None), (wide[:9, :k], None),
                 (wide[:, :k], None), (gate, up)):  # fmt: skip
        xq = quantize_rows(x, u, natural=True)
        with torch.inference_mode():
            got = ga8.gemv_gguf_a8(xq, qw, torch.float32, bias)
        assert got.shape == (x.shape[0], 37)
        for i in range(x.shape[0]):
            one = quantize_row(x[i : i + 1].contiguous(), None if u is None else u[i : i + 1], natural=True)
            assert all(torch.equal(a[i], b) for a, b in zip(xq, one)), (fmt, i)
            if u is None:
                assert_quantized_as([t[i] for t in xq], x[i])
            row = x[i] if u is None else (torch.nn.functional.silu(gate[i]) * up[i])
            want = reference(row if u is None else row.to(x.dtype), qw, bias)
            err = (got[i].double() - want).abs().max().item()
            assert err <= 1e-5 * want.abs().max().item(), (fmt, x.shape[0], i, err)


def test_rows_dispatch(monkeypatch):
    """gemm_q (gemm_q.py) runs 2..MAX_ROWS rows of a GGUF weight kept as stored on int8 activations (SwiGLU's
    too, in the quantize kernel), with the multi-row GEMV's numbers; Q4_0 / Q4_1 / Q8_0 / Q4_K rows past them (or
    rows the A8 GEMV does not take: Q8_0 of an odd number of blocks) go to the dequantizing GEMM (gemm_gguf.py) up to
    gemm_q.GGUF_GEMM's rows, with its numbers; one row, more rows, and Q5_K / Q6_K past the A8 GEMV are declined
    (to dequantize + cuBLAS)."""
    from polyfuse.backends.triton.quant import gemm_q
    from polyfuse.backends.triton.quant.gemm_gguf import gemm_gguf
    from polyfuse.backends.triton.swiglu import swiglu_forward

    qw = qf.quantize("gguf_q4_1", torch.randn(48, 512) * 0.05)
    x = torch.randn(2, 3, 512)
    assert gemm_q.accepts_linear_q(x, qw) is None
    assert gemm_q.accepts_linear_q(torch.randn(1, 1, 512), qw) is not None
    assert gemm_q.accepts_linear_q(torch.randn(gemm_q.GGUF_GEMM["gguf_q4_1"] + 1, 512), qw) is not None
    assert gemm_q.accepts_swiglu_linear_q(x, x, qw) is None
    q8 = qf.quantize("gguf_q8_0", torch.randn(48, 480))  # 15 blocks a row: the A8 GEMV reads Q8_0 blocks by pairs
    assert not ga8.accepts_rows(torch.randn(2, 480), q8) and gemm_q.accepts_linear_q(torch.randn(2, 480), q8) is None
    assert "more than 32 rows" in gemm_q.accepts_linear_q(torch.randn(33, 480), q8)
    q4k = qf.quantize("gguf_q4_k", torch.randn(48, 512))
    assert gemm_q.accepts_linear_q(torch.randn(32, 512), q4k) is None
    assert "more than 32 rows" in gemm_q.accepts_linear_q(torch.randn(33, 512), q4k)
    assert gemm_q.accepts_linear_q(torch.randn(64, 512), qw) is None  # Q4_1: to 64
    q5 = qf.quantize("gguf_q5_k", torch.randn(48, 512))
    assert "GEMM" in gemm_q.accepts_linear_q(torch.randn(ga8.MAX_ROWS + 1, 512), q5)  # measured slower
    q6 = qf.quantize("gguf_q6_k", torch.randn(48, 512))
    assert gemm_q.accepts_linear_q(torch.randn(ga8.MAX_ROWS + 1, 512), q6) is not None
    many = torch.randn(ga8.MAX_ROWS + 1, 512)
    assert not ga8.accepts_rows(many, qw) and gemm_q.accepts_linear_q(many, qw) is None
    with torch.inference_mode():
        assert torch.equal(gemm_q.linear_q(many, qw), gemm_gguf(many, None, qw))
    with torch.inference_mode():
        got = gemm_q.linear_q(x, qw)
        assert got.shape == (2, 3, 48)
        assert torch.equal(got.view(6, 48), ga8.gemv_gguf_a8(quantize_rows(x.view(6, 512), natural=True), qw, x.dtype))
        got = gemm_q.swiglu_linear_q(x, x * 0.5, qw)
        want = ga8.gemv_gguf_a8(quantize_rows(swiglu_forward(x, x * 0.5).view(6, 512), natural=True), qw, x.dtype)
        assert torch.equal(got.view(6, 48), want)
    with torch.inference_mode():
        assert torch.equal(gemm_q.linear_q(x, qw, options=OFF).view(6, 48), gemm_gguf(x.view(6, 512), None, qw))


def test_the_option_reaches_the_kernels_of_a_resolved_run():
    """gguf_a8=False in a run's flags reaches gemv_q's accepts through the registry: the one-row call then takes
    the float-activation GEMV (the registry binds the run's options; a default run keeps the A8 path)."""
    qw = qf.quantize("gguf_q4_1", torch.randn(48, 512) * 0.05)
    x = torch.randn(1, 1, 512)
    got = {}
    for a8 in (True, False):
        ctx = SelectionContext(torch.device("cpu"), flags={"gguf_a8": a8})
        with torch.inference_mode():
            got[a8] = registry.bound("linear_q", "gemv_q", ctx)(x, qw)
    from polyfuse.backends.triton.quant.gemv_gguf import gemv_gguf

    with torch.inference_mode():
        assert torch.equal(got[True].view(1, -1), ga8.gemv_gguf_a8(quantize_row(x, natural=True), qw, x.dtype))
        assert torch.equal(got[False].view(1, -1), gemv_gguf(x.view(1, 512), None, qw))
    assert not torch.equal(got[True], got[False])


@pytest.mark.slow
def test_accepts_and_the_dispatch(monkeypatch):
    """On unless the option gguf_a8 is off; on, one-row GGUF linear_q, swiglu_linear_q and add_rms_norm_linear_q (the gemv_q
    implementations) run the A8 kernel and give its numbers; other formats, Q8_0 / Q4_0 rows of an odd number of
    blocks, several rows and an up of another dtype are declined to the float-activation GEMV; off, every call."""
    from polyfuse.backends.triton.quant import gemv_q, norm_gemv_q
    from polyfuse.backends.triton.swiglu import swiglu_forward

    qw = qf.quantize("gguf_q5_k", torch.randn(48, 512) * 0.05)
    x = torch.randn(1, 512)
    assert not ga8.accepts(x, qw, options=OFF)
    assert norm_gemv_q.accepts_add_rms_norm_linear_q(x, x, torch.rand(512), 1e-6, qw, options=OFF) is not None
    assert ga8.accepts(x, qw) and ga8.accepts(x[:, :256].bfloat16(), qf.quantize("gguf_q4_k", torch.randn(8, 256)))
    for fmt in ("gguf_q6_k", "gguf_q8_0", "gguf_q4_0", "gguf_q4_1"):
        assert ga8.accepts(x, qf.quantize(fmt, torch.randn(48, 512)))
    assert ga8.accepts(x[:, :480], qf.quantize("gguf_q4_1", torch.randn(48, 480)))
    assert not ga8.accepts(x[:, :480], qf.quantize("gguf_q8_0", torch.randn(48, 480)))  # 15 blocks: no pairs
    assert not ga8.accepts(x[:, :480], qf.quantize("gguf_q4_0", torch.randn(48, 480)))
    assert not ga8.accepts(x, qf.quantize("int4", torch.randn(48, 512)))
    assert not ga8.accepts(torch.randn(2, 512), qw)
    assert not ga8.accepts(x, qw, up=torch.randn(1, 512).bfloat16())
    calls = []
    real = ga8.gemv_gguf_a8
    monkeypatch.setattr(ga8, "gemv_gguf_a8", lambda *a, **k: calls.append(1) or real(*a, **k))
    gate, up = torch.randn(1, 1, 512), torch.randn(1, 1, 512)
    weight, res = torch.rand(512), torch.randn(1, 1, 512)
    with torch.inference_mode():
        got = gemv_q.linear_q(x.view(1, 1, 512), qw)
        assert torch.equal(got.view(1, -1), real(quantize_row(x, natural=True), qw, x.dtype))
        got = gemv_q.swiglu_linear_q(gate, up, qw)
        want = real(quantize_row(swiglu_forward(gate, up), natural=True), qw, x.dtype)
        assert torch.equal(got.view(1, -1), want)
        assert norm_gemv_q.accepts_add_rms_norm_linear_q(x.view(1, 1, 512), res, weight, 1e-6, qw) is None
        out, total = norm_gemv_q.add_rms_norm_linear_q(x.view(1, 1, 512), res, weight, 1e-6, qw)
        xw, dx, rs, r = norm_quantize_row(x, res.view(1, 512), weight, 1e-6, natural=True)
        assert torch.equal(out.view(1, -1), real((xw, dx, rs), qw, x.dtype)) and torch.equal(total.view(1, -1), r)
        assert len(calls) == 3
        gemv_q.linear_q(x[:, :480], qf.quantize("gguf_q8_0", torch.randn(48, 480)))
    assert len(calls) == 3


@pytest.mark.slow
def test_tiny_gguf_decode_equals_the_native_model_on_the_same_int8_activations(tmp_path, monkeypatch):
    """Greedy decode of a tiny GGUF (q/k/v Q5_K, o Q4_K, gate/up Q4_1, down Q8_0) through the A8 path
    against the native model whose projections get the same int8 activations (benchmarks/harness/act_int8.py): the same tokens,
    each one-row step's logits within float32 rounding."""
    from benchmarks.harness.act_int8 import emulate_int8_activations_
    from polyfuse.models.llama import LlamaForCausalLM

    few = {fmt: {"tile": [64, 256, 1, 1]} for fmt in ("gguf_q4_k_a8", "gguf_q5_k_a8", "gguf_q4_1_a8", "gguf_q8_0_a8")}
    ctx = SelectionContext(
        torch.device("cpu"), flags={"tile_configs": tile_options(tmp_path / "tiles", **few).tile_configs}
    )
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=301)  # fmt: skip
    types = {"q_proj": "Q5_K", "k_proj": "Q5_K", "v_proj": "Q5_K", "o_proj": "Q4_K", "gate_proj": "Q4_1",
             "up_proj": "Q4_1", "down_proj": "Q8_0"}  # fmt: skip
    write_tiny_gguf(tmp_path / "tiny.gguf", LlamaForCausalLM.from_config(cfg, seed=5), types)
    ids = torch.tensor([[5, 17, 9, 42, 7]])
    calls = []
    real = ga8.gemv_gguf_a8
    monkeypatch.setattr(ga8, "gemv_gguf_a8", lambda *a, **k: calls.append(a[1].format) or real(*a, **k))
    runs, steps = {}, {}
    for name in ("a8", "emulated"):
        model = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", quant="gguf")
        if name == "a8":  # few programs a launch (tile_configs): the interpreter
            for op in ("linear_q", "swiglu_linear_q", "add_rms_norm_linear_q"):
                setattr(model.kernels, op, registry.bound(op, "gemv_q", ctx))
        else:
            emulate_int8_activations_(model)
        steps[name] = record_last_logits_(model)
        runs[name] = model.generate(ids, max_new_tokens=4, ignore_eos=True)
    # 3 one-row steps x 2 layers x (q/k/v, o, gate/up, down), and the prompt's last layer past q/k/v: o, gate/up and
    # down on its last row only (models/decoder.py prune_last_layer)
    assert sorted(set(calls)) == ["gguf_q4_1", "gguf_q4_k", "gguf_q5_k", "gguf_q8_0"] and len(calls) == 3 * 2 * 4 + 3
    assert torch.equal(runs["a8"], runs["emulated"])
    for got, want in list(zip(steps["a8"], steps["emulated"]))[1:]:
        assert (got - want).abs().max() <= 2e-5 * want.abs().max()


@pytest.mark.slow
def test_tiny_gguf_batch_decode_equals_the_native_model_on_the_same_int8_activations(tmp_path, monkeypatch):
    """Batch 2 greedy decode of a tiny GGUF (Q4_K, Q6_K, Q4_0, Q8_0 projections) through gemm_q's multi-row GEMVs
    (the 10-row prompt in launches of 8 and 2 rows, every 2-row step) against the native model fed the same int8
    activations: the same tokens, the logits within float32 rounding."""
    from benchmarks.harness.act_int8 import emulate_int8_activations_
    from polyfuse.models.llama import LlamaForCausalLM

    def few(entry):  # few programs a launch: the interpreter
        return {**entry, "rows": {**entry.get("rows", {}), "2": [16, 256, 1, 1], "8": [16, 256, 1, 1]}}

    fmts = ("gguf_q4_k_a8", "gguf_q6_k_a8", "gguf_q4_0_a8", "gguf_q8_0_a8")
    ctx = SelectionContext(
        torch.device("cpu"),
        flags={"tile_configs": tile_options(tmp_path / "tiles", **dict.fromkeys(fmts, few)).tile_configs},
    )
    monkeypatch.setattr(ga8, "MAX_ROWS", 16)  # the 10-row prompt too, as two launches (8 + 2 rows)
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=301)  # fmt: skip
    types = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q4_K", "o_proj": "Q6_K", "gate_proj": "Q4_0",
             "up_proj": "Q4_0", "down_proj": "Q8_0"}  # fmt: skip
    write_tiny_gguf(tmp_path / "tiny.gguf", LlamaForCausalLM.from_config(cfg, seed=6), types)
    ids = torch.tensor([[5, 17, 9, 42, 7], [3, 8, 250, 11, 60]])
    calls = []
    real = ga8.gemv_gguf_a8
    monkeypatch.setattr(ga8, "gemv_gguf_a8", lambda *a, **k: calls.append(a[0][0].shape[0]) or real(*a, **k))
    runs, steps = {}, {}
    for name in ("a8", "emulated"):
        model = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", quant="gguf")
        if name == "a8":
            k = model.kernels
            k.linear_q = registry.bound("linear_q", "gemm_q", ctx)
            k.swiglu_linear_q = registry.bound("swiglu_linear_q", "gemm_q", ctx)
            norm, add_norm, lin = k.rms_norm, k.add_rms_norm, k.linear_q

            def norm_linear(x, residual, weight, eps, qweight, bias=None, norm=norm, add_norm=add_norm, lin=lin):
                y, r = (norm(x, weight, eps), x) if residual is None else add_norm(x, residual, weight, eps)
                return lin(y, qweight, bias), r

            k.add_rms_norm_linear_q = norm_linear
        else:
            emulate_int8_activations_(model)
        steps[name] = record_last_logits_(model)
        runs[name] = model.generate(ids, max_new_tokens=4, ignore_eos=True)
    # (the prompt's 10 rows + 3 steps of 2) x 2 layers x (q/k/v, o, gate/up, down); the prompt's last layer runs o,
    # gate/up and down on each sequence's last row (2 rows: models/decoder.py prune_last_layer)
    assert sorted(calls) == sorted([10] * 5 + [2] * 3 + [2] * 24), calls
    assert torch.equal(runs["a8"], runs["emulated"])
    for got, want in zip(steps["a8"], steps["emulated"]):
        assert (got - want).abs().max() <= 2e-5 * want.abs().max()
