"""Quantized weights (docs/quantization.md): formats, kernels, loading, saving and quality on the built-in model.

* formats: AutoGPTQ's int4 packing against a transcription of AutoGPTQ's own packing loop, and a round trip; the GGUF
  dequantization against the ``gguf`` package's, bit for bit; quantization error bounds per format;
* kernels (beyond tests/test_kernels_conformance.py, which runs every implementation on tests/quant_cases.py): the
  split-K, fp8 bit-decoding and act-order paths against the float32 reference; fp8 ``torch._scaled_mm`` against
  the same arithmetic done by hand (activations quantized per token); the Q4_1 GEMV on the built-in model's weights;
* loading and saving on a tiny Llama: ``quant=`` at load, save -> load back as stored (no re-quantization), ``none``
  dequantizes, shapes a format cannot pack stay float with one warning naming them, AutoGPTQ and compressed-tensors
  checkpoints (act-order GPTQ with different g_idx per fused part: dequantized at load), a GGUF with kept, mixed and
  unkept types; one-row decode through the Triton GEMV gives the native reference's tokens;
* quality: perplexity of the built-in model (SmolLM2-135M, Q4_1) over 1022 tokens of examples/data.
"""

import copy
import dataclasses
import importlib.metadata
import json
import logging
import math
import os
import sys

import numpy as np
import pytest
import torch
from helpers import linear_q_taker, one_thread, tiny_config, write_tiny_gguf  # noqa: F401  (one_thread: autouse)
from quant_cases import act_order, quantized, random_gguf

from polyfuse.core import registry
from polyfuse.models.llama import LlamaForCausalLM
from polyfuse.ops import quant_formats as qf
from polyfuse.quant import quantize as qz
from polyfuse.quant import report as quant_report
from polyfuse.quant.checkpoint import Checkpoint
from polyfuse.quant.qlinear import QLinear, QLinearStack, quantized_modules


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "examples", "data", "declaration_of_independence.txt")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ---- formats -------------------------------------------------------------------------------------------------------


def autogptq_pack(intweight: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ's QuantLinear.pack loop for 4 bits, transcribed: intweight [K, N] (0..15), zeros [G, N] (stored minus
    one)."""
    intweight = intweight.astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    i, row = 0, 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    zeros = (zeros - 1).astype(np.uint32) & 15
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint32)
    i, col = 0, 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= zeros[:, j] << (4 * (j - i))
        i += 8
        col += 1
    return qweight.view(np.int32), qzeros.view(np.int32)


def test_gptq_packing_is_autogptqs_and_round_trips():
    gen = torch.Generator().manual_seed(0)
    k, n, g = 256, 24, 2
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(1, 17, (g, n), generator=gen, dtype=torch.int32)
    qweight, qzeros = qf.pack_int4(q, zeros)
    ref_w, ref_z = autogptq_pack(q.numpy(), zeros.numpy())
    assert np.array_equal(qweight.numpy(), ref_w) and np.array_equal(qzeros.numpy(), ref_z)
    assert qweight.dtype == qzeros.dtype == torch.int32 and (qweight < 0).any()  # the top nibble's high bit
    qw = qf.QuantizedWeight("int4", (n, k), qweight, torch.ones(g, n, dtype=torch.float16), qzeros,
                            torch.arange(k, dtype=torch.int32) // 128, 128)  # fmt: skip
    q2, z2 = qf.unpack_int4(qw)
    assert torch.equal(q2, q) and torch.equal(z2, zeros)  # zeros 1..16 stored minus one in 4 bits
    # and the value: (q - zero) * scale with the group of each k
    w = qf.dequantize(qw)
    assert torch.equal(w, (q - zeros[torch.arange(k) // 128]).float().t())


@pytest.mark.parametrize("n,k,group", [(24, 136, 128), (16, 200, 64), (64, 96, 32), (8, 8, 128)])
def test_int4_in_order_dequantize_equals_the_per_weight_gather(n, k, group):
    """The in-order int4 dequantize (bytes unpacked along K, each group's zero and scale broadcast) gives the bits of
    the per-weight (q - zero[g_idx[k]]) * scale[g_idx[k]], with random scales and a last partial group."""
    gen = torch.Generator().manual_seed(3)
    qw = qf.quantize("int4", torch.randn(n, k, generator=gen), group)
    assert not qw.act_order and qw.scales.shape[0] == -(-k // group) and len(set(qw.scales.flatten().tolist())) > 1
    assert qf._in_group_order(qw) and not qf._in_group_order(dataclasses.replace(qw, group_size=0))  # both paths run
    q, zeros = qf.unpack_int4(qw)
    g = qw.g_idx.long()
    ref = ((q - zeros[g]).float() * qw.scales.float()[g]).t()
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(qf.dequantize(qw, dtype), ref.to(dtype))
        assert torch.equal(qf.dequantize(dataclasses.replace(qw, group_size=0), dtype), ref.to(dtype))  # gathered


@pytest.mark.parametrize("fmt,bound", [("int8", 0.009), ("fp8", 0.03), ("fp8_block", 0.03), ("int4", 0.12),
                                       ("gguf_q8_0", 0.01), ("gguf_q4_0", 0.12), ("gguf_q4_1", 0.12),
                                       ("gguf_q4_k", 0.12), ("gguf_q5_k", 0.06), ("gguf_q6_k", 0.03)])  # fmt: skip
def test_quantize_dequantize_error_and_layout(fmt, bound):
    gen = torch.Generator().manual_seed(1)
    n, k = 48, 320 if fmt not in qf.K_QUANTS else 512  # K: a partial int4 group and fp8 block
    w = torch.randn(n, k, generator=gen) * 0.02
    qw = qf.quantize(fmt, w)
    for name, c in qf.components(fmt, n, k).items():
        t = getattr(qw, name)
        assert (tuple(t.shape), t.dtype) == (c.shape, c.dtype), name
    assert rel(qf.dequantize(qw), w) < bound
    assert qf.dequantize(qw, torch.bfloat16).dtype == torch.bfloat16


def test_gguf_32_weight_quantizer_is_the_gguf_packages():
    """Q8_0 / Q4_0 / Q4_1 packed by our torch quantizer (random-weight benchmarks pack 8B models with it on the GPU)
    equal the gguf package's bytes (llama.cpp's reference quantizer in float32 numpy, as of gguf 0.19): zero blocks,
    ties, blocks of one value, blocks below float32's normal range (1 / d overflows: quants 0). A block whose minimum
    is both +0.0 and -0.0 takes the first, as ggml's C does (numpy may take the other: same value, other m bytes)."""
    gguf = pytest.importorskip("gguf")
    version = importlib.metadata.version("gguf")
    if tuple(int(p) for p in version.split(".")[:2]) < (0, 19):
        pytest.skip(f"checked against gguf 0.19's quantizer, not {version}'s")
    tricky = tricky_32_weights()
    tricky[6] = 0.1  # its signed zeros: the gguf package's numpy reductions may pick the other zero (same value)
    for fmt, ggml in (("gguf_q8_0", "Q8_0"), ("gguf_q4_0", "Q4_0"), ("gguf_q4_1", "Q4_1")):
        ref = gguf.quants.quantize(tricky.numpy(), gguf.GGMLQuantizationType[ggml])
        assert np.array_equal(qf.quantize(fmt, tricky).qweight.numpy(), ref), fmt
    gen = torch.Generator().manual_seed(3)
    w = torch.rand(2, 32, generator=gen) * 0.1
    w[:, 3], w[:, 7] = torch.tensor([0.0, -0.0]), torch.tensor([-0.0, 0.0])
    m = qf.quantize("gguf_q4_1", w).qweight[:, 2:4].contiguous().view(torch.float16)[:, 0]
    assert torch.equal(torch.signbit(m), torch.tensor([False, True])) and torch.all(m == 0)
    zeros = torch.zeros(2, 32)
    zeros[0, 0] = zeros[1, 1:] = -0.0  # [-0, +0 ...] and [+0, -0 ...]: C's Q4_0 d = +0 / -8, Q4_1's d = max - min
    d0 = qf.quantize("gguf_q4_0", zeros).qweight[:, :2].contiguous().view(torch.float16)[:, 0]
    d1 = qf.quantize("gguf_q4_1", zeros).qweight[:, :2].contiguous().view(torch.float16)[:, 0]
    assert torch.equal(torch.signbit(d0), torch.tensor([True, True]))
    assert torch.equal(torch.signbit(d1), torch.tensor([False, False]))


def tricky_32_weights() -> torch.Tensor:
    """Rows that tell the packers apart: random blocks, ties, zero and one-value blocks, signed zeros, blocks whose 1 / d
    overflows, and scaled values whose product with 1 / d rounds differently from a division."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(64, 256, generator=gen) * 0.05
    w[0, :32], w[1, :32], w[2, :16] = 0.0, 0.01, 1e-9  # a zero block, a block of one value, a half-tiny one
    w[3, :32] = torch.tensor([0.5, -0.5] * 16)
    w[4] = torch.round(w[4] * 100) / 100  # ties in the scaled values
    w[5, :32], w[5, 32] = 1e-40, -2e-40  # 1 / d overflows
    w[6, :32] = -0.0
    w[6, 40], w[6, 50] = 0.0, -0.0
    w[7:] *= torch.logspace(-3, 3, 57).unsqueeze(1)
    return w


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["gguf_q8_0", "gguf_q4_0", "gguf_q4_1"])
def test_gguf_32_weight_quantizer_on_cuda_writes_the_cpu_bytes(fmt):
    """On a CUDA device (where a tensor divided by a Python number is multiplied by its reciprocal, and reductions
    pick among equal values in their own order) the packer writes the CPU's bytes, which are llama.cpp's."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    w = tricky_32_weights()
    assert torch.equal(qf.quantize(fmt, w.cuda()).qweight.cpu(), qf.quantize(fmt, w).qweight)


def test_gguf_dequantization_is_the_gguf_packages():
    gguf = pytest.importorskip("gguf")
    gen = torch.Generator().manual_seed(2)
    for fmt, ggml in (("gguf_q8_0", "Q8_0"), ("gguf_q4_0", "Q4_0"), ("gguf_q4_1", "Q4_1")):
        qw = qf.quantize(fmt, torch.randn(16, 96, generator=gen))
        ref = gguf.quants.dequantize(qw.qweight.numpy(), gguf.GGMLQuantizationType[ggml])
        assert np.array_equal(qf.dequantize(qw).numpy(), ref), fmt


@pytest.mark.parametrize("fmt,ggml", [("gguf_q4_k", "Q4_K"), ("gguf_q5_k", "Q5_K"), ("gguf_q6_k", "Q6_K")])
def test_k_quant_dequantization_is_the_gguf_packages_on_any_bytes(fmt, ggml):
    """Super-blocks of random bytes (every scale, min and quant bit pattern; finite fp16 d / dmin) dequantize to the
    gguf package's values bit for bit, and so do the ones our quantizer writes (the layout llama.cpp reads)."""
    gguf = pytest.importorskip("gguf")
    gen = torch.Generator().manual_seed(5)
    n, nb, nbytes = 24, 3, qf.GGUF_BYTES[fmt]
    raw = torch.randint(0, 256, (n, nb, nbytes), generator=gen, dtype=torch.uint8)
    for at in (208,) if fmt == "gguf_q6_k" else (0, 2):
        d = (torch.rand(n, nb, generator=gen) * 0.02 - 0.005).half()
        raw[..., at : at + 2] = d.view(torch.uint8).reshape(n, nb, 2)
    raw = raw.reshape(n, nb * nbytes)
    ref = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[ggml]).reshape(n, nb * 256)
    ours = qf.dequantize(qf.QuantizedWeight(fmt, (n, nb * 256), raw)).numpy()
    assert np.array_equal(ours, ref)
    qw = qf.quantize(fmt, torch.randn(8, 512, generator=gen) * 0.05)
    ref = gguf.quants.dequantize(qw.qweight.numpy(), gguf.GGMLQuantizationType[ggml]).reshape(8, 512)
    assert np.array_equal(qf.dequantize(qw).numpy(), ref)


def test_cannot_pack():
    assert qf.cannot_pack("int4", 36, (64,)) and qf.cannot_pack("int4", 64, (60, 4))
    assert qf.cannot_pack("int4", 64, (64, 32)) is None and qf.cannot_pack("int4", 576, (576,)) is None
    assert qf.cannot_pack("gguf_q4_1", 48, (8,)) and qf.cannot_pack("int8", 7, (3,)) is None
    assert (
        "multiple of 256" in qf.cannot_pack("gguf_q4_k", 576, (64,)) and qf.cannot_pack("gguf_q6_k", 512, (8,)) is None
    )


# ---- kernels -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt",
    [
        "int8",
        "fp8",
        "fp8_block",
        "int4",
        "int4_act",
        "gguf_q8_0",
        "gguf_q4_0",
        "gguf_q4_1",
        "gguf_q4_k",
        "gguf_q5_k",
        "gguf_q6_k",
        "random_q4_k",
        "random_q5_k",
        "random_q6_k",
    ],
)
@pytest.mark.slow
def test_gemv_paths_against_the_reference(fmt):
    """Every kernel with K split over programs (partials summed by the last program), SwiGLU folded in and a bias, in float32."""
    pytest.importorskip("triton")
    from polyfuse.backends.triton.quant.gemv_gguf import gemv_gguf
    from polyfuse.backends.triton.quant.gemv_gguf_kquant import gemv_gguf_kquant
    from polyfuse.backends.triton.quant.gemv_int4 import gemv_int4
    from polyfuse.backends.triton.quant.gemv_int8_fp8 import gemv_int8_fp8

    kernel = gemv_int4 if fmt.startswith("int4") else gemv_gguf if fmt.startswith("gguf") else gemv_int8_fp8
    kquant = fmt in qf.K_QUANTS or fmt.startswith("random")
    kernel = gemv_gguf_kquant if kquant else kernel
    k = 768 if kquant else 544
    # random_*: super-blocks of random bytes (negative and zero d, Q6_K's negative scales), as llama.cpp files hold
    qw = random_gguf("gguf_" + fmt[7:], 40, k, seed=4) if fmt.startswith("random") else quantized(fmt, 40, k, "cpu")
    gen = torch.Generator().manual_seed(3)
    x, up, bias = (
        torch.randn(1, k, generator=gen),
        torch.randn(1, k, generator=gen),
        torch.randn(40, generator=gen),
    )
    w = qf.dequantize(qw)
    # int4 in group order sums (2 + q / 8) x and takes (16 + z) s sum x off per group: that cancellation costs about
    # two bits of float32 here (measured 1.2e-6 and, on other seeds, up to 2.9e-6; with a common offset of 30 on the
    # activations 1.3e-5, the old kernel 6e-7): still about 8 bits below the bf16 outputs the kernel makes on the GPU
    bound = 4e-6 if fmt == "int4" else 1e-6
    for split in (1, 3):
        assert rel(kernel(x, None, qw, bias, split=split), x @ w.t() + bias) < bound, split
        ref = (torch.nn.functional.silu(x) * up) @ w.t()
        assert rel(kernel(x, up, qw, None, split=split), ref) < bound, split
    if fmt.startswith("fp8"):  # GPUs without fp8 conversions decode the bits by integer arithmetic
        assert torch.equal(
            gemv_int8_fp8(x, None, qw, None, fp8_bits=True), gemv_int8_fp8(x, None, qw, None, fp8_bits=False)
        )


def test_gemv_tiles_per_projection(tmp_path):
    """A projection with its own swept tile gets it; another shape the format's; a tile_configs folder's entry for
    the format (tuning runs) replaces both, and leaves the other formats as they were."""
    pytest.importorskip("triton")
    from quant_cases import tile_options

    from polyfuse.backends.triton.quant import gemv_common

    table = gemv_common.gemv_tiles("cpu")
    assert table.tile("fp8", 6144, 4096) == table.shapes["fp8"][(6144, 4096)] != table.formats["fp8"]
    assert (8192, 4096) not in table.shapes["fp8"]
    assert table.tile("fp8", 8192, 4096) == table.formats["fp8"]
    tuning = gemv_common.gemv_tiles("cpu", tile_options(tmp_path, fp8={"tile": [64, 128, 4, 3]}))
    assert tuning.tile("fp8", 6144, 4096) == tuning.tile("fp8", 8192, 4096) == (64, 128, 4, 3)
    assert tuning.tile("int8", 6144, 4096) == table.tile("int8", 6144, 4096)


def test_gemv_int4_group_sizes():
    """AutoGPTQ group sizes 32 and 64, and one group over all of K (group_size -1: K not a power of two)."""
    pytest.importorskip("triton")
    from polyfuse.backends.triton.quant.gemv_int4 import gemv_int4

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 192, generator=gen)
    for g in (32, 64, 192):
        qw = qf.quantize("int4", torch.randn(16, 192, generator=gen), group_size=g)
        assert rel(gemv_int4(x, None, qw), x @ qf.dequantize(qw).t()) < 4e-6, g  # the bound: see the test above


def test_scaled_mm_is_per_token_fp8_arithmetic():
    """The fp8 scaled_mm implementation (torch._scaled_mm also runs on the CPU) against activations quantized to
    e4m3 per token by hand times the dequantized weight: the same numbers up to bf16 output rounding."""
    from helpers import cpu_scaled_mm_missing

    from polyfuse.backends.cuda.scaled_mm import accepts_linear_q, linear_q

    if cpu_scaled_mm_missing():
        pytest.skip(cpu_scaled_mm_missing())
    qw = quantized("fp8", 48, 96, "cpu")
    x = (torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    assert accepts_linear_q(x, qw) is None
    assert accepts_linear_q(x.float(), qw) and accepts_linear_q(x, quantized("int8", 48, 96, "cpu"))
    x2 = x.float().reshape(-1, 96)
    amax = x2.abs().amax(-1, keepdim=True)
    xq = (x2 * torch.full_like(amax, 448.0).div(amax)).to(torch.float8_e4m3fn).float() * (amax / 448.0)
    ref = (xq @ qf.dequantize(qw).t()).view(2, 3, 48)
    got = linear_q(x, qw)
    assert got.dtype == torch.bfloat16 and rel(got.float(), ref) < 4e-3
    assert rel(got.float(), torch.nn.functional.linear(x, qf.dequantize(qw, torch.bfloat16)).float()) > 4e-3


@pytest.mark.slow
def test_scaled_mm_fast_accumulation_option(monkeypatch):
    """torch._scaled_mm gets use_fast_accum on GPUs only in a run with the kernel option fp8_fast_accum (off by
    default), never on the CPU; the option reaches scaled_mm_rows from the run's flags through the registry."""
    from polyfuse.core import registry
    from polyfuse.core.context import SelectionContext
    from polyfuse.core.kernel_options import KernelOptions
    from polyfuse.ops import quant_linear as ql

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    on = KernelOptions(fp8_fast_accum=True)
    assert not ql.fast_accum(gpu) and ql.fast_accum(gpu, on) and not ql.fast_accum(cpu, on)
    seen = []
    monkeypatch.setattr(ql, "fast_accum", lambda device, options: seen.append((device, options.fp8_fast_accum)) or 7)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: seen.append(k["use_fast_accum"]) or torch.zeros(2, 48))
    qw = quantized("fp8", 48, 96, "cpu")
    ql.scaled_mm_rows(torch.zeros(2, 96).to(torch.float8_e4m3fn), torch.ones(2, 1), qw, torch.zeros(2, 96))
    assert seen == [(cpu, False), 7]
    seen.clear()
    x = torch.randn(2, 96).bfloat16()
    for fast in (False, True):  # cuda:scaled_mm bound as a run with the option set or not would bind it
        registry.bound("linear_q", "scaled_mm", SelectionContext(cpu, flags={"fp8_fast_accum": fast}))(x, qw)
    assert seen == [(cpu, False), 7, (cpu, True), 7]


def test_triton_fp8_row_quantization_is_torchs():
    """triton:fp8_scaled_mm's one-kernel per-token quantization writes the bytes and scales of the plain-torch one
    (cuda:scaled_mm's: amax, x * (448 / amax), clamp, cast), on bf16 rows with an all-zero row, an outlier and values
    that land among the e4m3 subnormals; its e4m3 encoding equals torch's cast on every e4m3 value, every midpoint
    between neighbours (ties to even) and values just off them; and the GEMM on top equals cuda:scaled_mm's."""
    from helpers import cpu_scaled_mm_missing

    from polyfuse.backends.cuda import scaled_mm as plain
    from polyfuse.backends.triton.quant import fp8_scaled_mm as fused

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the GPU's own fp8 cast, or the interpreter
    gen = torch.Generator().manual_seed(11)
    for k in (96, 4096):
        x = (torch.randn(67, k, generator=gen) * 3).bfloat16()
        x[3] = 0
        x[5, 7] = 1e4
        x[6] = (torch.randn(k, generator=gen) * 1e-3).bfloat16()
        x[6, 0] = 100
        x = x.to(dev)
        (q1, s1), (q2, s2) = fused.quantize_rows(x), plain.quantize_rows(x)
        assert q1.dtype == torch.float8_e4m3fn and torch.equal(s1, s2)
        assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)), k
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    probe = torch.cat([vals, mids, vals * 1.001, mids * 0.999, mids * 1.001])
    probe = probe[probe <= 448.0]
    probe = torch.cat([probe, -probe, torch.tensor([448.0])]).view(1, -1).to(dev)  # 448: the row's scale is 1
    q, s = fused.quantize_rows(probe)
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8), probe.to(torch.float8_e4m3fn).view(torch.uint8))
    if dev == "cpu" and cpu_scaled_mm_missing():
        return
    qw = quantized("fp8", 48, 96, dev)
    x = (torch.randn(2, 40, 96, generator=gen) * 3).bfloat16().to(dev)
    assert fused.accepts_linear_q(x, qw) is None and fused.accepts_linear_q(x[:, :30], qw)  # 60 rows: the GEMM's
    assert torch.equal(fused.linear_q(x, qw), plain.linear_q(x, qw))
    # swiglu_linear_q: SwiGLU in the quantizing kernel = the SwiGLU kernel's bf16 output, quantized, multiplied
    from polyfuse.backends.triton.swiglu import swiglu_forward

    gate, up = ((torch.randn(2, 40, 96, generator=gen) * 3).bfloat16().to(dev) for _ in range(2))
    assert fused.accepts_swiglu_linear_q(gate, up, qw) is None and fused.accepts_swiglu_linear_q(gate[:1], up[:1], qw)
    (q1, s1), (q2, s2) = (
        fused.swiglu_quantize_rows(gate.view(80, 96), up.view(80, 96)),
        plain.quantize_rows(swiglu_forward(gate, up).view(80, 96)),
    )
    assert torch.equal(s1, s2) and torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(fused.swiglu_linear_q(gate, up, qw), plain.linear_q(swiglu_forward(gate, up), qw))


def test_fp8_activations_are_what_scaled_mm_multiplies():
    """ops/quant_linear.py ``fp8_activations`` (what benchmarks/harness/act_fp8.py's W8A8 emulation feeds the weight-only
    reference) times the dequantized weight, in float32, against torch._scaled_mm on the same e4m3 rows and scales
    (``fp8_token_rows``, which cuda:scaled_mm runs): the same products, summed in another order. With 128-column
    groups an outlier coarsens only its own group: the other groups round as without it."""
    from helpers import cpu_scaled_mm_missing

    from polyfuse.backends.cuda import scaled_mm as plain
    from polyfuse.ops.quant_linear import fp8_activations, fp8_token_rows, scaled_mm_rows

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 23, 256, generator=gen) * 2
    x[0, 3] = 0
    x[1, 5, 7] = 3e3  # one token with a massive activation
    values = fp8_activations(x)
    q, scale = fp8_token_rows(x.view(-1, 256))
    assert torch.equal(plain.quantize_rows(x.view(-1, 256))[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(values.view(-1, 256), q.float() * scale) and torch.equal(values[0, 3], x[0, 3])
    assert 0 < (values - x).abs().max() / x.abs().amax() < 2**-4  # e4m3: 3 mantissa bits
    grouped = fp8_activations(x, 128)
    assert torch.equal(grouped[:, :, 128:][1, 5], fp8_activations(x[1, 5, 128:]))  # the outlier's other group
    assert not torch.equal(grouped[1, 5, 128:], values[1, 5, 128:])
    assert torch.equal(grouped[0], fp8_activations(x[0].reshape(-1, 128)).view(23, 256))
    qw = quantized("fp8", 48, 256, "cpu")
    want = values @ qf.dequantize(qw).t()
    if cpu_scaled_mm_missing():
        return
    got = scaled_mm_rows(q, scale, qw, x)  # float32 output: x's dtype
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5, atol=1e-3 * want.abs().max()), (
        (got - want).abs().max()
    )


# ---- the tiny model: load, save, checkpoints ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_float")
    model = LlamaForCausalLM.from_config(tiny_config(num_key_value_heads=2, attention_bias=True), seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(path))
    return str(path)


IDS = torch.randint(10, 300, (2, 9), generator=torch.Generator().manual_seed(7))


def logits(model):
    with torch.inference_mode():
        return model(IDS).logits


def assert_computes_as(kept, dense) -> torch.Tensor:
    """A model kept quantized computes what its dequantized twin does: logits within 1e-5 (relative norm) and the same
    greedy tokens; returns the twin's logits."""
    want = logits(dense)
    assert rel(logits(kept), want) < 1e-5
    ids = torch.tensor([[5, 17, 9, 42]])
    out_kept = kept.generate(ids, max_new_tokens=6, do_sample=False, ignore_eos=True)
    assert torch.equal(out_kept, dense.generate(ids, max_new_tokens=6, do_sample=False, ignore_eos=True))
    return want


def packed_state(model) -> dict:
    return {name: t.clone() for name, t in qz.quantized_state_items(model)}


@pytest.mark.parametrize("fmt,bound", [("int8", 0.02), ("fp8", 0.08), ("fp8_block", 0.08), ("int4", 0.35)])
def test_quantize_at_load_save_and_load_back_as_stored(tiny_dir, tmp_path, monkeypatch, fmt, bound):
    ref = logits(LlamaForCausalLM.from_pretrained(tiny_dir))
    model = LlamaForCausalLM.from_pretrained(tiny_dir, quant=fmt)
    assert all(isinstance(m, QLinear) and m.format == fmt for m in quantized_modules(model).values())
    assert len(quantized_modules(model)) == 8 and not isinstance(model.lm_head, QLinear)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    out = logits(model)
    assert rel(out, ref) < bound
    model.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        q_weight = f.get_tensor("model.layers.0.self_attn.q_proj.weight") if fmt != "int4" else None
    if fmt == "int4":  # an AutoGPTQ checkpoint: its config and its tensor names
        assert config == {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "desc_act": False,
                          "checkpoint_format": "gptq", "lm_head": False}  # fmt: skip
        assert {f"model.layers.0.self_attn.k_proj.{c}" for c in ("qweight", "qzeros", "scales", "g_idx")} <= keys
        assert "model.layers.0.self_attn.q_proj.weight" not in keys
    else:
        assert config["quant_method"] == "polyfuse" and config["formats"]["model.layers.1.mlp.up_proj"] == fmt
        assert {"model.layers.0.self_attn.v_proj.qweight", "model.layers.0.self_attn.v_proj.scales"} <= keys
        assert q_weight.shape == (0,)  # the empty placeholder transformers refuses (tests/test_hf_quantizer.py)
    assert "model.layers.0.self_attn.q_proj.bias" in keys
    # Back as stored: nothing is quantized again, the same packed tensors and logits.
    monkeypatch.setattr(qz, "quantize_components", lambda *a, **k: pytest.fail("quantized again"))
    again = LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert torch.equal(logits(again), out)
    a, b = packed_state(model), packed_state(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    # --quant none: dequantized at load, float modules, the same function.
    dense = LlamaForCausalLM.from_pretrained(str(tmp_path), quant="none")
    assert not quantized_modules(dense) and not hasattr(dense.config, "quantization_config")
    assert rel(logits(dense), out) < 1e-5


def test_quantize_model_in_place_equals_quantize_at_load(tiny_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_dir)
    qz.quantize_model_(model, "int4")
    loaded = LlamaForCausalLM.from_pretrained(tiny_dir, quant="int4")
    a, b = packed_state(model), packed_state(loaded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(logits(model), logits(loaded))


def test_shapes_a_format_cannot_pack_keep_float_with_one_warning(tmp_path, caplog):
    """Head dim 6 with 2 kv heads: k and v are 12 rows each, so q/k/v fused cannot hold int4's 8-column zeros
    words; o, gate/up and down can."""
    cfg = tiny_config(hidden_size=48, num_attention_heads=8, num_key_value_heads=2, intermediate_size=64)
    LlamaForCausalLM.from_config(cfg, seed=1).save_pretrained(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        model = LlamaForCausalLM.from_pretrained(str(tmp_path), quant="int4")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("warning: --quant int4: int4 packs 8 weights per int32"), lines
    assert "(2 projection(s): model.layers.0.self_attn.qkv_proj, model.layers.1.self_attn.qkv_proj)" in lines[0]
    layer = model.model.layers[1]
    assert type(layer.self_attn.qkv_proj) is torch.nn.Linear
    assert all(isinstance(m, QLinear) for m in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert torch.isfinite(logits(model)).all()


def test_bad_requests(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="choose one of"):
        LlamaForCausalLM.from_pretrained(tiny_dir, quant="int3")
    with pytest.raises(ValueError, match="not a GGUF"):
        LlamaForCausalLM.from_pretrained(tiny_dir, quant="gguf")
    LlamaForCausalLM.from_pretrained(tiny_dir, quant="int8").save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="already quantized"):
        LlamaForCausalLM.from_pretrained(str(tmp_path), quant="int4")
    assert quantized_modules(LlamaForCausalLM.from_pretrained(str(tmp_path), quant="int8"))  # same format: fine


def _write_checkpoint(path, config: dict, tensors: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))


def _split_state(model) -> dict:
    from polyfuse.loader.load import hf_state_items

    return {k: v.clone() for k, v in hf_state_items(model)}


PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def _quantized_checkpoint(tiny_dir, out, fmt, writer, config):
    """The float checkpoint with every projection replaced by ``writer(name, weight)``'s tensors; returns the float
    model whose projections hold the dequantized weights (what the quantized checkpoint means)."""
    model = LlamaForCausalLM.from_pretrained(tiny_dir)
    state, ref = _split_state(model), {}
    for name in list(state):
        if name.endswith(".weight") and any(f".{p}." in name for p in PROJ):
            w = state.pop(name)
            tensors, deq = writer(name[: -len(".weight")], w)
            state.update(tensors)
            ref[name] = deq
    raw = json.loads(open(os.path.join(tiny_dir, "config.json")).read())
    _write_checkpoint(out, dict(raw, quantization_config=config), state)
    from polyfuse.loader.load import load_weights

    expected = LlamaForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        load_weights(expected, list({**_split_state(expected), **ref}.items()))
    return expected


def test_autogptq_checkpoint_loads_as_stored(tiny_dir, tmp_path):
    def writer(prefix, w):
        qw = qf.quantize("int4", w)
        t = {f"{prefix}.{c}": getattr(qw, c) for c in ("qweight", "qzeros", "scales", "g_idx")}
        if prefix.endswith(("gate_proj", "up_proj", "down_proj")):  # bias-free: AutoGPTQ writes zero biases
            t[f"{prefix}.bias"] = torch.zeros(qw.shape[0], dtype=torch.float16)
        return t, qf.dequantize(qw)

    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False}
    expected = _quantized_checkpoint(tiny_dir, str(tmp_path), "int4", writer, cfg)
    model = LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert {m.format for m in quantized_modules(model).values()} == {"int4"}
    assert rel(logits(model), logits(expected)) < 1e-5
    dense = LlamaForCausalLM.from_pretrained(str(tmp_path), quant="none")  # dequantized at load, part by part
    assert not quantized_modules(dense) and rel(logits(dense), logits(expected)) < 1e-5


def test_act_order_gptq_with_different_g_idx_per_fused_part_is_dequantized(tiny_dir, tmp_path, caplog):
    def writer(prefix, w):
        qw = act_order(qf.quantize("int4", w, group_size=32))
        if prefix.endswith("k_proj"):  # another permutation than q's and v's
            qw = dataclasses.replace(qw, g_idx=qw.g_idx.flip(0).contiguous())
        return {f"{prefix}.{c}": getattr(qw, c) for c in ("qweight", "qzeros", "scales", "g_idx")}, qf.dequantize(qw)

    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False}
    expected = _quantized_checkpoint(tiny_dir, str(tmp_path), "int4", writer, cfg)
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        model = LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert len(caplog.records) == 1 and "different g_idx" in caplog.records[0].getMessage()
    assert type(model.model.layers[0].self_attn.qkv_proj) is torch.nn.Linear  # dequantized at load
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.gate_up_proj, QLinear) and mlp.gate_up_proj.act_order  # gate/up share one g_idx
    assert rel(logits(model), logits(expected)) < 1e-5


def test_a_shared_buffer_is_written_before_another_part_compares_with_it():
    """Fused parts share act-order's g_idx: the first part read writes it, the others compare theirs with it. The
    loader reads on several threads, so the compare must not run between the first part's claim and its copy (a
    spurious "differs between the parts" on a loaded CI machine). The second part's write runs inside the first one's
    release of the loader's lock, the interleaving that failed."""
    import threading

    setup = qz.QuantSetup(None, Checkpoint("gptq", "int4", 32), False, "cpu", torch.float32)
    q = QLinear(64, 256, "int4", False, torch.float32, group_size=32, parts=(128, 128))
    g_idx = torch.randperm(64, generator=torch.Generator().manual_seed(0)) // 32
    real, calls = threading.Lock(), []

    class Interleaving:
        def __enter__(self):
            real.acquire()

        def __exit__(self, *exc):
            real.release()
            if not calls:
                calls.append("second part")
                setup._write("mlp", q, "g_idx", slice(128, 256), g_idx.clone(), "up_proj")

    setup.lock = Interleaving()
    q.g_idx.fill_(-1)  # what an unwritten buffer may hold
    setup._write("mlp", q, "g_idx", slice(0, 128), g_idx.clone(), "gate_proj")
    assert calls == ["second part"] and torch.equal(q.g_idx, g_idx.to(q.g_idx.dtype))
    with pytest.raises(qz.CheckpointError, match="differs between the parts fused into mlp"):
        setup._write("mlp", q, "g_idx", slice(128, 256), g_idx.flip(0), "up_proj")


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_compressed_tensors_fp8_checkpoint(tiny_dir, tmp_path, strategy):
    def writer(prefix, w):
        n, k = w.shape
        if strategy == "channel":
            qw = qf.quantize("fp8", w)
            return {f"{prefix}.weight": qw.qweight, f"{prefix}.weight_scale": qw.scales[:, None].bfloat16(),
                    f"{prefix}.input_scale": torch.ones(1)}, qw.qweight.float() * qw.scales.bfloat16().float()[:, None]  # fmt: skip
        nb, kb = math.ceil(n / 128), math.ceil(k / 128)
        blocks = torch.nn.functional.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
        scale = blocks.abs().amax((1, 3)) / 448.0
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        q = (w / full).to(torch.float8_e4m3fn)
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale}, q.float() * full

    weights = {"type": "float", "num_bits": 8, "strategy": strategy}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    cfg = {"quant_method": "compressed-tensors", "format": "float-quantized",
           "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}}, "ignore": ["lm_head"]}  # fmt: skip
    expected = _quantized_checkpoint(tiny_dir, str(tmp_path), "fp8", writer, cfg)
    model = LlamaForCausalLM.from_pretrained(str(tmp_path))
    fmt = "fp8" if strategy == "channel" else "fp8_block"
    assert {m.format for m in quantized_modules(model).values()} == {fmt}
    assert rel(logits(model), logits(expected)) < 1e-5


def test_one_row_decode_through_the_triton_gemv(tiny_dir):
    """Greedy decode of an int4 model (one row per projection: the GEMV, SwiGLU folded) gives the native tokens."""
    pytest.importorskip("triton")
    model = LlamaForCausalLM.from_pretrained(tiny_dir, quant="int4")
    ids = IDS[:1]
    want = model.generate(ids, max_new_tokens=4, ignore_eos=True)
    calls = []
    for op in ("linear_q", "swiglu_linear_q"):
        fn = registry.bound(op, "gemv_q")
        setattr(model.kernels, op, lambda *a, _fn=fn, _op=op, **k: calls.append((_op, a[0].shape)) or _fn(*a, **k))
    got = model.generate(ids, max_new_tokens=4, ignore_eos=True)
    assert torch.equal(got, want)
    assert ("swiglu_linear_q", torch.Size([1, 1, 128])) in calls and ("linear_q", torch.Size([1, 1, 64])) in calls


def test_report_names_formats_and_kernels(tiny_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_dir, quant="int4")
    text = quant_report.report(model)
    assert "8 projection(s)" in text and "int4 weight-only, AutoGPTQ layout, asymmetric, group 128: 8" in text
    assert (
        "  linear_q: native (dequantize + F.linear)" in text
        and "  swiglu_linear_q: composite swiglu + linear_q" in text
    )
    assert quant_report.report(LlamaForCausalLM.from_pretrained(tiny_dir)) == ""


def test_gguf_kept_where_a_kernel_takes_it():
    from polyfuse.core.context import SelectionContext
    from polyfuse.core.platform import Platform

    cpu = SelectionContext(torch.device("cpu"))
    gpu = SelectionContext(
        torch.device("cuda"), torch.bfloat16, platform=Platform("cuda", "cuda", "NVIDIA H200", (9, 0))
    )
    assert not qz._kernel_takes_quantized(cpu)
    if registry.implementations("linear_q")[0].unusable_reason(gpu) is None:  # triton importable
        assert qz._kernel_takes_quantized(gpu)
        gpu.overrides = "-linear_q"
        assert not qz._kernel_takes_quantized(gpu)


def test_gguf_kept_mixed_and_unkept_types(tmp_path, caplog):
    """q/k Q4_1 with v Q8_0 (one fused projection, two types: a QLinearStack, q/k one Q4_1 weight, v one Q8_0), o Q4_0
    and gate/up Q8_0 (kept), down Q5_0 (no kernel: dequantized with one warning); the kept model computes what the
    dequantized one does."""
    cfg = tiny_config(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=301)  # fmt: skip
    model = LlamaForCausalLM.from_config(cfg, seed=2)
    types = {"q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q4_0", "gate_proj": "Q8_0",
             "up_proj": "Q8_0", "down_proj": "Q5_0"}  # fmt: skip
    write_tiny_gguf(tmp_path / "tiny.gguf", model, types)
    dense = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")  # CPU default: dequantized
    assert not quantized_modules(dense)
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        kept = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", quant="gguf")
    got = {n: (m.format, m.parts, [p for p, _ in m.hf_parts]) for n, m in quantized_modules(kept).items()}
    attn = "model.layers.0.self_attn"
    assert got == {
        f"{attn}.qkv_proj.segments.0": ("gguf_q4_1", (256, 128), [f"{attn}.q_proj", f"{attn}.k_proj"]),
        f"{attn}.qkv_proj.segments.1": ("gguf_q8_0", (128,), [f"{attn}.v_proj"]),
        f"{attn}.o_proj": ("gguf_q4_0", (256,), [f"{attn}.o_proj"]),
        "model.layers.0.mlp.gate_up_proj": ("gguf_q8_0", (256, 256), ["model.layers.0.mlp.gate_proj",
                                                                      "model.layers.0.mlp.up_proj"]),
    }  # fmt: skip
    lines = sorted(r.getMessage() for r in caplog.records)
    assert len(lines) == 1, lines
    assert "GGUF type Q5_0 has no quantized kernel: dequantized at load" in lines[0] and "down_proj" in lines[0]
    assert rel(logits(kept), logits(dense)) < 1e-6
    assert "1 fused projection(s) with parts in different formats" in quant_report.report(kept)


def test_gguf_k_quants_kept_as_a_q4_k_m_file_mixes_them(tmp_path, caplog):
    """A Q4_K_M-style file: q/k, o and gate/up Q4_K, v and down Q6_K. Every projection is kept, without a warning (the
    native reference on the CPU; the Triton kernels have their conformance cases): q/k/v as a QLinearStack of a Q4_K
    q/k weight and a Q6_K v weight. It computes what the dequantized model does, greedy tokens included; saved, it
    loads back as stored (polyfuse's layout, per-part formats), and dequantized (quant="none") as the same floats."""
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=301)  # fmt: skip
    model = LlamaForCausalLM.from_config(cfg, seed=4)
    types = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q4_K",
             "up_proj": "Q4_K", "down_proj": "Q6_K"}  # fmt: skip
    write_tiny_gguf(tmp_path / "tiny.gguf", model, types)
    dense = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        kept = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", quant="gguf")
    formats = {n.removeprefix("model.layers.0."): m.format for n, m in quantized_modules(kept).items()}
    assert formats == {"self_attn.qkv_proj.segments.0": "gguf_q4_k", "self_attn.qkv_proj.segments.1": "gguf_q6_k",
                       "self_attn.o_proj": "gguf_q4_k", "mlp.gate_up_proj": "gguf_q4_k",
                       "mlp.down_proj": "gguf_q6_k"}  # fmt: skip
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    want = assert_computes_as(kept, dense)
    kept.save_pretrained(tmp_path / "saved")
    qc = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert qc["formats"]["model.layers.0.self_attn.v_proj"] == "gguf_q6_k"
    assert qc["formats"]["model.layers.0.self_attn.k_proj"] == "gguf_q4_k"
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert isinstance(back.model.layers[0].self_attn.qkv_proj, QLinearStack)
    assert torch.equal(logits(back), logits(kept))
    floats = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"), quant="none")
    assert not quantized_modules(floats) and rel(logits(floats), want) < 1e-5


@pytest.mark.parametrize("head_type", ["Q6_K", "Q8_0"])
def test_gguf_output_weight_kept_as_the_head(tmp_path, caplog, monkeypatch, head_type):
    """quant_lm_head=True (--quant_lm_head): a GGUF's own output.weight (untied) in a kept type is the LM head as
    stored (a Q4_K_M file's Q6_K head: 0.43 against 1.05 GB of bf16 read per token for Llama 3), computed as the
    dequantized head; greedy tokens equal; a save loads back with the head packed, and dequantized with
    quant="none". Unasked, or in a type without a kernel, or in a float type, the head loads as floats (no
    warning)."""
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=301)  # fmt: skip
    model = LlamaForCausalLM.from_config(cfg, seed=7)
    types = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q4_K",
             "up_proj": "Q4_K", "down_proj": "Q6_K"}  # fmt: skip
    write_tiny_gguf(tmp_path / "tiny.gguf", model, {**types, "lm_head": head_type})
    dense = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    assert not isinstance(dense.lm_head, QLinear)
    unasked = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", quant="gguf")
    assert not isinstance(unasked.lm_head, QLinear) and len(quantized_modules(unasked)) == 5
    with pytest.raises(ValueError, match="loaded with quant_lm_head=True"):  # packing it afterwards: which format?
        qz.quantize_lm_head_(unasked)
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        kept = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", quant="gguf", quant_lm_head=True)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert isinstance(kept.lm_head, QLinear) and kept.lm_head.format == qf.GGUF_TYPES[head_type]
    head = qf.dequantize(kept.lm_head.quantized_weight(), torch.float32)
    torch.testing.assert_close(head, dense.lm_head.weight, rtol=0, atol=0)  # the stored blocks, exactly
    want = assert_computes_as(kept, dense)
    kept.save_pretrained(tmp_path / "saved")
    qc = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert qc["formats"]["lm_head"] == qf.GGUF_TYPES[head_type]
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert isinstance(back.lm_head, QLinear) and torch.equal(logits(back), logits(kept))
    floats = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"), quant="none")
    assert not isinstance(floats.lm_head, QLinear) and rel(logits(floats), want) < 1e-5
    from polyfuse.cli import generate as cli  # the CLI's --quant_lm_head loads it so (tokenizer aside)

    argv = ["--model_name_or_path", str(tmp_path), "--gguf_file", "tiny.gguf", "--quant", "gguf", "--quant_lm_head"]
    monkeypatch.setattr(cli, "load_cli_tokenizer", lambda *a: None)
    loaded, _ = cli.load(cli.build_parser().parse_args(argv), torch.device("cpu"), {})
    assert isinstance(loaded.lm_head, QLinear) and loaded.lm_head.format == qf.GGUF_TYPES[head_type]
    for other in ("Q5_0", None):  # no kernel for Q5_0; None: written as float32
        path = tmp_path / f"other_{other}"
        path.mkdir()
        write_tiny_gguf(path / "tiny.gguf", model, {**types, **({"lm_head": other} if other else {})})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="polyfuse"):
            plain = LlamaForCausalLM.from_pretrained(
                str(path), gguf_file="tiny.gguf", quant="gguf", quant_lm_head=True
            )
        assert (
            not isinstance(plain.lm_head, QLinear) and len(quantized_modules(plain)) == 5
        )  # q/k + v, o, gate/up, down
        assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_gguf_q5_k_file_with_q6_k_down_keeps_every_projection(tmp_path, caplog):
    """q/k/v, o and gate/up Q5_K, down Q6_K: every projection kept (q/k/v fused in one Q5_K weight), no warning, the
    dequantized model's logits and greedy tokens. (A real Q5_K_M file also gives v Q6_K in some layers: their q/k/v
    is dequantized, as Q4_K_M's.)"""
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=301)  # fmt: skip
    model = LlamaForCausalLM.from_config(cfg, seed=6)
    types = dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"), "Q5_K")
    write_tiny_gguf(tmp_path / "tiny.gguf", model, {**types, "down_proj": "Q6_K"})
    dense = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        kept = LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", quant="gguf")
    formats = {n.split(".")[-1]: m.format for n, m in quantized_modules(kept).items()}
    assert formats == {"qkv_proj": "gguf_q5_k", "o_proj": "gguf_q5_k", "gate_up_proj": "gguf_q5_k",
                       "down_proj": "gguf_q6_k"}  # fmt: skip
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert_computes_as(kept, dense)


@pytest.mark.parametrize("fmt", ["gguf_q5_k", "gguf_q4_0"])
def test_random_weights_in_gguf_types(fmt):
    """from_config(quant="gguf_q5_k") (benchmark_generation.py --quant gguf_*): every projection packed as a
    llama.cpp GGUF type by round to nearest, whose logits are the dequantized model's; unknown names are refused."""
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=301)  # fmt: skip
    model = LlamaForCausalLM.from_config(cfg, seed=2, quant=fmt)
    assert {m.format for m in quantized_modules(model).values()} == {fmt}
    assert len(quantized_modules(model)) == 4
    dense = LlamaForCausalLM.from_config(cfg, seed=2)
    want = dense.state_dict()  # the packed model's embedding, norms and head; its projections dequantized below
    dense.load_state_dict({k: v for k, v in model.state_dict().items() if k in want}, strict=False)
    for name, q in quantized_modules(model).items():
        dense.get_submodule(name).weight.data.copy_(qf.dequantize(q.quantized_weight()))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert rel(model(ids).logits, dense(ids).logits) < 1e-5
    with pytest.raises(ValueError, match="for random weights"):
        LlamaForCausalLM.from_config(cfg, seed=2, quant="q5_k")


def test_benchmark_generation_quant_smoke(tmp_path, monkeypatch):
    """benchmarks/benchmark_generation.py --quant on the CPU at the tiny shape (in process: no interpreter start)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "benchmark_generation", os.path.join(ROOT, "benchmarks", "benchmark_generation.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gen.jsonl"
    monkeypatch.setattr(sys, "argv", ["benchmark_generation.py", "--shapes", "tiny", "--batch_sizes", "1", "--new_tokens",
        "3", "--prompt_len", "8", "--peers", "", "--prefill", "", "--flags", "", "--quant", "int4", "--output", str(out)])  # fmt: skip
    bench.main()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    model = next(r for r in rows if r["what"] == "model")
    assert model["quant"] == "int4" and model["backends"]["linear_q"] == "native"
    decode = [r for r in rows if r["what"] == "decode"]
    assert [(r["impl"], r["quant"]) for r in decode] == [("polyfuse", "int4")] and decode[0]["tok_per_s"] > 0


def test_benchmark_generation_quant_prefill_without_torchao(tmp_path, monkeypatch, capsys):
    """--quant with --prefill builds the torchao peer; without torchao the run warns once and measures polyfuse
    (it used to end in a traceback at the import)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "benchmark_generation", os.path.join(ROOT, "benchmarks", "benchmark_generation.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    out = tmp_path / "gen.jsonl"
    monkeypatch.setattr(sys, "argv", ["benchmark_generation.py", "--shapes", "tiny", "--batch_sizes", "1", "--new_tokens",
        "3", "--prompt_len", "8", "--peers", "", "--prefill", "16", "--flags", "", "--quant", "int8", "--output", str(out)])  # fmt: skip
    bench.main()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["impl"] for r in rows if r["what"] == "prefill"] == ["polyfuse"]
    assert capsys.readouterr().err.count("warning: torchao is not installed") == 1


# ---- quality on the built-in model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtin():
    from benchmarks.harness.perplexity import token_windows
    from polyfuse.checkpoint.tokenizer import load_tokenizer
    from polyfuse.models import AutoModelForCausalLM
    from polyfuse.models.builtin import builtin_model

    try:
        path, gguf = builtin_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tokenizer = load_tokenizer(path, gguf)
    with open(TEXT, encoding="utf-8") as f:
        ids = torch.tensor(tokenizer(f.read(), add_special_tokens=False).input_ids)
    windows = token_windows(ids, 512, 1024)
    dense = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, quant="none")
    return path, gguf, windows, dense


@pytest.fixture(scope="module")
def baseline(builtin):
    from benchmarks.harness.perplexity import perplexity

    return perplexity(builtin[3], builtin[2])[0]


@pytest.mark.slow
def test_gguf_q4_1_kept_equals_its_dequantized_run(builtin, baseline, monkeypatch):
    from benchmarks.harness.perplexity import perplexity
    from polyfuse.models import AutoModelForCausalLM

    path, gguf, windows, _ = builtin
    kept = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, quant="gguf")
    mods = quantized_modules(kept)
    assert len(mods) == 120 and {m.format for m in mods.values()} == {"gguf_q4_1"}
    ppl, n = perplexity(kept, windows)
    assert n == 1022 and abs(ppl / baseline - 1) < 0.005, (ppl, baseline)
    # The Triton GEMV on real Q4_1 rows (64 of layer 0's gate/up, and of its down projection with SwiGLU), on int8
    # activations (the default) against the float product of the activations quantized the same way, and on float
    # activations (the kernel option gguf_a8 off) against the float product.
    pytest.importorskip("triton")
    from benchmarks.harness.act_int8 import int8_activations
    from polyfuse.backends.triton.quant.gemv_q import linear_q, swiglu_linear_q
    from polyfuse.core.kernel_options import KernelOptions

    def rows(q):
        qw = q.quantized_weight()
        return dataclasses.replace(qw, qweight=qw.qweight[:64], shape=(64, qw.shape[1]))

    mlp = kept.model.layers[0].mlp
    gate_up, down = rows(mlp.gate_up_proj), rows(mlp.down_proj)
    x = torch.randn(1, 1, 576, generator=torch.Generator().manual_seed(8))
    g, u = torch.randn(2, 1, 1, 1536, generator=torch.Generator().manual_seed(9))
    for a8 in (True, False):
        options = KernelOptions(gguf_a8=a8)
        act = int8_activations if a8 else (lambda t: t)
        got = linear_q(x, gate_up, options=options)
        assert rel(got, torch.nn.functional.linear(act(x), qf.dequantize(gate_up))) < 1e-6
        ref = torch.nn.functional.linear(act(torch.nn.functional.silu(g) * u), qf.dequantize(down))
        assert rel(swiglu_linear_q(g, u, down, options=options), ref) < 1e-6


# Measured on this text (2 windows of 512 tokens, float32, CPU): dequantized Q4_1 19.714; int8 19.839 (+0.63%);
# fp8 20.760 (+5.3%); int4 32.09 (+63%). The issue's targets are fp8/int8 within 1% and int4 within 5%: int8 meets
# its target; fp8 e4m3 rounds every weight by ~2.6% (relative) and int4 round-to-nearest with groups of 128 by ~10%
# on weights that are already 4-bit (Q4_1 in groups of 32), and this 135M model is that sensitive to them: the bounds
# below hold the measured quality (docs/quantization.md), they do not meet those two targets.
BOUNDS = {"int8": 0.01, "fp8": 0.07, "int4": 0.75}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(BOUNDS))
def test_perplexity_of_quantized_builtin_model(builtin, baseline, fmt):
    from benchmarks.harness.perplexity import perplexity

    model = copy.deepcopy(builtin[3])
    qz.quantize_model_(model, fmt)
    assert len(quantized_modules(model)) == 120
    ppl, _ = perplexity(model, builtin[2])
    assert 0 <= ppl / baseline - 1 < BOUNDS[fmt], (fmt, ppl, baseline)


# GPTQ (quant/gptq.py) calibrated on the text's tokens after the 1024 scored ones (679 tokens, 2 windows), same
# scoring: fp8 19.285 (-2.18%), int8 19.797 (+0.42%), int4 24.578 (+24.7%); before q/k/v's H weighed each window's
# first tokens (gptq.sink_weighted): -0.33%, +0.43%, +97.6% (round to nearest: +5.30%, +0.63%, +62.8% on this
# already-4-bit model; docs/quantization.md). Bounds: fp8 at most the issue's 1% above the float model's, int8 and
# int4 below their round-to-nearest's; none more than 5% below it (calibrated on the same document, GPTQ may fit it
# a little better than the float weights do, not by that much).
GPTQ_FLOOR = -0.05
GPTQ_BOUNDS = {"fp8": 0.01, "int8": 0.0063, "int4": 0.35}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(GPTQ_BOUNDS))
def test_perplexity_of_gptq_quantized_builtin_model(builtin, baseline, fmt):
    from benchmarks.harness.perplexity import perplexity, token_windows
    from polyfuse.checkpoint.tokenizer import load_tokenizer

    path, gguf, windows, dense = builtin
    with open(TEXT, encoding="utf-8") as f:
        ids = torch.tensor(load_tokenizer(path, gguf)(f.read(), add_special_tokens=False).input_ids)
    calibration = token_windows(ids[1024:], 512)  # not scored: the scored windows are the first 1024 tokens
    assert sum(len(w) for w in calibration) == 679
    model = copy.deepcopy(dense)
    qz.quantize_model_(model, fmt, calibration)
    assert len(quantized_modules(model)) == 120
    ppl, _ = perplexity(model, windows)
    assert GPTQ_FLOOR < ppl / baseline - 1 < GPTQ_BOUNDS[fmt], (fmt, ppl, baseline)


@pytest.mark.slow
def test_perplexity_with_the_lm_head_int8(builtin, baseline):
    """--quant_lm_head int8 on the built-in model (its head is the tied 49152 x 576 embedding): the loss through the
    packed head's logits; measured on these windows +0.77% against +0.63% with the head in float (docs/quantization.md)."""
    from benchmarks.harness.perplexity import perplexity

    model = copy.deepcopy(builtin[3])
    qz.quantize_model_(model, "int8")
    assert qz.quantize_lm_head_(model) and isinstance(model.lm_head, QLinear)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the embedding itself is untouched
    ppl, _ = perplexity(model, builtin[2])
    assert 0 <= ppl / baseline - 1 < 0.015, (ppl, baseline)


@pytest.mark.slow
def test_perplexity_with_int8_activations(builtin, baseline):
    """int4 with its projections' activations quantized to int8 in blocks of 32 (the option int4_a8's decode, emulated
    on every position: benchmarks/harness/act_int8.py), token by token against int4 alone. Measured on these windows: each
    token's loss moves by 0.082-0.083 nats on average (absolute), the perplexity by -0.17% .. +1.10% (over AVX-512,
    AVX2 and unvectorized CPU kernels, and embeddings jittered by 1e-7: activation rounding flips amplify float
    noise; its standard error over 1022 tokens is about 0.45%). Held: the mean move in 0.04..0.16 nats, the
    perplexity within -1.5% .. +2.5% of int4's."""
    from benchmarks.harness.act_int8 import emulate_int8_activations_
    from benchmarks.harness.perplexity import perplexity, token_nll

    model = copy.deepcopy(builtin[3])
    qz.quantize_model_(model, "int4")
    int4, n = perplexity(model, builtin[2])
    nll4 = token_nll(model, builtin[2])
    assert len(nll4) == n and abs(math.exp(nll4.double().mean()) / int4 - 1) < 1e-4, (nll4.double().mean(), int4)
    emulate_int8_activations_(model)
    moved = token_nll(model, builtin[2]) - nll4
    assert 0.04 < moved.abs().mean() < 0.16, moved.abs().mean()
    assert -0.015 < math.expm1(moved.double().mean()) < 0.025, moved.double().mean()


@pytest.mark.slow
def test_gguf_perplexity_with_int8_activations(builtin, baseline):
    """The built-in Q4_1 GGUF kept, its projections' activations quantized to int8 in blocks of 32 (the GGUF one-row
    GEMV's default on the GPU, emulated on every position: benchmarks/harness/act_int8.py), token by token against the GGUF kept
    on float activations (whose perplexity equals the float model's). Measured on these windows: each token's loss
    moves by 0.077-0.084 nats on average (absolute), the perplexity by -0.46% .. +1.03% (jittered embeddings and
    CPU kernels, as the int4 case above): the issue's 0.5% is met by the weight-only GEMV (gguf_a8 off), not
    shown for this one. Held: the mean move in 0.04..0.16 nats, the perplexity within 1.5%."""
    from benchmarks.harness.act_int8 import emulate_int8_activations_
    from benchmarks.harness.perplexity import token_nll
    from polyfuse.models import AutoModelForCausalLM

    path, gguf, windows, _ = builtin
    kept = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, quant="gguf")
    nll = token_nll(kept, windows)
    assert abs(math.exp(nll.double().mean()) / baseline - 1) < 1e-4, (nll.double().mean(), baseline)
    emulate_int8_activations_(kept)
    moved = token_nll(kept, windows) - nll
    assert 0.04 < moved.abs().mean() < 0.16, moved.abs().mean()
    assert abs(math.expm1(moved.double().mean())) < 0.015, moved.double().mean()


@pytest.mark.slow
def test_perplexity_with_fp8_activations(builtin):
    """fp8 scored with its activations rounded to e4m3 per token (fp8_block: per token and 128 columns) as a GPU's
    W8A8 prefill GEMMs round them (benchmarks/harness/act_fp8.py), token by token against the weight-only fp8 the CPU runs.
    Measured on these windows (on the CPU): fp8 weight-only +5.30%, W8A8 +10.02% (the H200's bf16 prefill:
    +8.2% .. +8.8% unjittered, docs/quantization.md); each token's loss moves by 0.205 nats on average (absolute),
    the perplexity by +4.5%. fp8_block +3.91% -> +4.88%, 0.087 nats: only the down projection (K = 1536) has K a
    multiple of 128 on this model, and a token's outlier coarsens one group, not its row. Held: fp8's mean move in
    0.1..0.4 nats and +1.5% .. +9% of perplexity; fp8_block's mean move below half of fp8's; every fp8 projection
    taken (K and N multiples of 16)."""
    from benchmarks.harness.act_fp8 import emulate_fp8_activations_, takes_w8a8
    from benchmarks.harness.perplexity import token_nll

    moves = {}
    for fmt in ("fp8", "fp8_block"):
        model = copy.deepcopy(builtin[3])
        qz.quantize_model_(model, fmt)
        taken = [takes_w8a8(m.quantized_weight()) for m in quantized_modules(model).values()]
        assert all(taken) if fmt == "fp8" else 0 < sum(taken) < len(taken), (fmt, sum(taken))
        nll = token_nll(model, builtin[2])
        emulate_fp8_activations_(model)
        moves[fmt] = token_nll(model, builtin[2]) - nll
    assert 0.1 < moves["fp8"].abs().mean() < 0.4, moves["fp8"].abs().mean()
    assert 0.015 < math.expm1(moves["fp8"].double().mean()) < 0.09, moves["fp8"].double().mean()
    assert moves["fp8_block"].abs().mean() < moves["fp8"].abs().mean() / 2


def test_evaluate_perplexity_int8_activations_suffix(capsys, monkeypatch):
    """--quant int4,int8+a8: one error line (the int8-activation paths are int4's and the GGUF's), exit 2, before any
    entry is scored."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import evaluate_perplexity

    assert evaluate_perplexity.main(["--quant", "int4,int8+a8", "--max_tokens", "64"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # int4 was not scored first
    err = err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evaluate_perplexity.py: error: --quant int8+a8: +a8 is for int4")


@pytest.mark.slow
def test_evaluate_perplexity_w8a8_suffix(builtin, capsys, monkeypatch):
    """--quant fp8,fp8+w8a8: the second entry scores the same fp8 weights with the W8A8 emulation (benchmarks/harness/act_fp8.py),
    so its per-token losses differ from the first's (the first 128 tokens: the emulation moves them, the weights
    are the same)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import evaluate_perplexity

    assert evaluate_perplexity.main(["--quant", "fp8,fp8+w8a8", "--max_tokens", "128", "--context", "64"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["quant"] for r in rows] == ["fp8", "fp8+w8a8"] and rows[1]["tokens"] == 126
    assert rows[1]["vs_first_se"] > 1e-3 and rows[1]["vs_first"] != 0, rows[1]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--text", "MISSING"], "--text MISSING: no such file"),
        (["--text", "FOLDER"], "a folder, not a text file"),
        (["--text", "LATIN1"], "not UTF-8 text"),
        (["--text", "EMPTY"], "no tokens to score: 0 token(s)"),
        (["--max_tokens", "1"], "no tokens to score: 1 token(s)"),
        (["--context", "1"], "--context must be >= 2"),
        (["--max_tokens", "-5"], "--max_tokens must be >= 0"),
        (["--samples", "0"], "--samples must be >= 1"),
        (["--quant", "none,foo"], "--quant 'foo': the format is one of auto, none, gguf"),
        (["--quant", "none,"], "--quant '': the format is one of"),
        (["--quant", "fp8_block+gptq"], "GPTQ quantizes int4, int8, fp8"),
        (["--quant", "int4+gptq+gptq"], "each at most once"),
        (["--quant", "none+lm_head"], "none keeps every weight float"),
        (["--quant", "int8+gptq", "--calibration_text", "EMPTY"], "EMPTY has too few (give a longer text)"),
        (["--quant", "int8+gptq"], "+gptq, +norms and +scales need calibration tokens: give --calibration_text"),
        (["--quant", "int4+norms"], "+gptq, +norms and +scales need calibration tokens: give --calibration_text"),
        (["--quant", "int4+scales"], "+gptq, +norms and +scales need calibration tokens: give --calibration_text"),
        (["--quant", "none,gguf+norms"], "+norms tunes the norms of a model quantized at load"),
        (["--quant", "none,gguf+scales"], "+scales tunes the scales of a model quantized at load"),
        (["--quant", "int4+scales+scales"], "suffixes are +gptq, +norms, +scales, +lm_head, +a8 and +w8a8, each"),
        (["--quant", "none,int8+w8a8"], "+w8a8 is for fp8, fp8_block (the formats a GPU multiplies on e4m3"),
        (["--quant", "int4+norms", "--norm_steps", "0"], "--norm_steps must be >= 1"),
        (["--quant", "int4,int4+gptq", "--norm_steps", "4"], "--norm_steps: no --quant entry has +norms or +scales"),
        (["--output", "FOLDER"], "--output FOLDER: a folder"),
        (["--output", "NOFOLDER/rows.jsonl"], "no such folder NOFOLDER"),
        (["--model_name_or_path", "SAVED"], "has no tokenizer"),
        (["--model_name_or_path", "SAVED", "--quant", "gguf"], "this model is not a GGUF"),
        (["--quant", "none,auto+lm_head", "--max_tokens", "40", "--context", "20"], "--quant auto+lm_head: "),
    ],
)
@pytest.mark.slow
def test_evaluate_perplexity_bad_input(builtin, tmp_path, capsys, monkeypatch, args, says):
    """Bad input: one ``error:`` line, exit 2, and --output untouched (rows are appended once every entry has run:
    the last case scores ``none`` first, then the float model's head cannot be quantized without a format). All but
    the last are refused before a model is loaded (not a traceback, not the whole text for a negative --max_tokens,
    not the default load for an empty --quant entry)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import evaluate_perplexity

    (tmp_path / "folder").mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 8)
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "config.json").write_text("{}")
    names = {"NOFOLDER": "nofolder", "MISSING": "missing.txt", "FOLDER": "folder", "LATIN1": "latin1.txt",
             "EMPTY": "empty.txt", "SAVED": "saved"}  # NOFOLDER before FOLDER, which it contains  # fmt: skip
    for key, name in names.items():
        args = [a.replace(key, str(tmp_path / name)) for a in args]
    says = says.replace("EMPTY", str(tmp_path / "empty.txt")).replace("MISSING", str(tmp_path / "missing.txt"))
    says = says.replace("NOFOLDER", str(tmp_path / "nofolder")).replace("FOLDER", str(tmp_path / "folder"))
    rows = tmp_path / "rows.jsonl"
    if "--output" not in args:
        args += ["--output", str(rows)]
    assert evaluate_perplexity.main(args) == 2
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evaluate_perplexity.py: error: ") and says in err[0], err
    assert not rows.exists()
    assert out.count("perplexity") == (1 if "auto+lm_head" in " ".join(args) else 0)


@pytest.mark.slow
def test_evaluate_perplexity_reports_the_paired_standard_error(builtin, capsys, monkeypatch):
    """Each entry's vs_first comes with vs_first_se, the standard error of the per-token loss differences against the
    first entry (paired): 0 for the first entry; for int8 on the built-in model's first 128 tokens it is a fraction
    of a percent (the unpaired std of the losses over sqrt(tokens) would be about 20%)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import evaluate_perplexity

    assert evaluate_perplexity.main(["--quant", "none,int8", "--max_tokens", "128", "--context", "64"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["quant"] for r in rows] == ["none", "int8"] and all(r["tokens"] == 126 for r in rows)
    assert rows[0]["vs_first"] == 0 and rows[0]["vs_first_se"] == 0
    assert 1e-4 < rows[1]["vs_first_se"] < 0.02, rows[1]
    assert abs(rows[1]["vs_first"]) < 0.05, rows[1]


@pytest.mark.slow
def test_evaluate_perplexity_samples_under_jittered_inputs(builtin, capsys, monkeypatch):
    """--samples 3: every entry is scored unjittered and under two jittered seeds, each against the first entry under
    the same draws: the first entry's samples are exactly 0 (the same draws on the same weights), int8's are three
    different numbers (the jitter reaches the losses) near its vs_first, and vs_first_mean is their mean."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import evaluate_perplexity

    args = ["--quant", "none,int8", "--max_tokens", "128", "--context", "64", "--samples", "3"]
    assert evaluate_perplexity.main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert rows[0]["samples_vs_first"] == [0.0, 0.0, 0.0] and rows[0]["vs_first_mean"] == 0.0, rows[0]
    samples = rows[1]["samples_vs_first"]
    assert len(samples) == 3 and samples[0] == rows[1]["vs_first"] and len(set(samples)) == 3, samples
    assert all(abs(v - samples[0]) < 0.02 for v in samples), samples
    assert rows[1]["vs_first_mean"] == pytest.approx(sum(samples) / 3), rows[1]


def test_jittered_inputs_draws_by_seed_and_leaves_the_model_as_it_was():
    """jittered_inputs: the same seed gives the same logits twice, another seed others, the change is of the order of
    its 0.4% noise on the embedding (not zero, not large), and the model is unjittered after the block."""
    from benchmarks.harness.perplexity import jittered_inputs

    model = LlamaForCausalLM.from_config(tiny_config(), dtype=torch.float32, seed=0)
    ids = torch.randint(3, 300, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        runs = []
        for seed in (1, 1, 2):
            with jittered_inputs(model, seed):
                runs.append(model(ids).logits)
        after = model(ids).logits
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    moved = ((runs[0] - plain).norm() / plain.norm()).item()
    assert 1e-4 < moved < 0.05, moved
    assert torch.equal(after, plain)


# ---- NVIDIA (make test-cuda) ---------------------------------------------------------------------------------------


# Teacher-forced next-token argmax over the text's windows: the share of positions where a quantized model picks the
# bf16 float model's token (measured on an H200: gguf 1.0 (a prompt runs dequantize + cuBLAS on the same bf16
# weights), int8 0.94, fp8 0.84, int4 0.58: round to nearest at 4 bits on a 135M model, +62% perplexity).
AGREE = {"gguf": 0.99, "int8": 0.9, "fp8": 0.8, "int4": 0.5}


@pytest.mark.cuda
@pytest.mark.parametrize("quant", ["gguf", "int8", "fp8", "int4"])
def test_cuda_builtin_model_quantized(builtin, quant):
    """On the GPU in bf16: the GGUF stays Q4_1 by default (a kernel takes it), --quant formats load; one-row decode
    runs the Triton GEMV, 8 rows the Triton GEMM, a 256-token prompt fp8 scaled_mm on fp8 tensor cores (the others
    dequantize + cuBLAS). Over the text's windows (512-token prompts) the next-token argmax agrees with the bf16 float
    model's at AGREE's share of positions and the perplexity is within the CPU bounds; the decode kernels' greedy
    tokens are the argmax of the same model under the native reference (dequantize + matmul, every linear_q op
    forced to it; for the GGUF, whose one-row GEMV multiplies int8 activations, with its projections' activations
    quantized the same way: benchmarks/harness/act_int8.py) on those tokens, 14 of 16 at least (the two round differently, so a
    near tie may flip; the GGUF against the float-activation reference agreed on 13 of 16 on an H200).
    Free-running greedy tokens against the float model's are not compared: this prompt has a near tie three tokens
    in, where the float model in bf16 and in float32 already part later on."""
    from benchmarks.harness.act_int8 import emulate_int8_activations_
    from benchmarks.harness.perplexity import perplexity
    from polyfuse.loader.load import set_kernels
    from polyfuse.models import AutoModelForCausalLM

    path, gguf, windows, _ = builtin
    flags = {"use_flash_attention": True, "use_cuda_graphs": True}
    load = dict(gguf_file=gguf, dtype=torch.bfloat16, device="cuda", flags=flags)
    dense = AutoModelForCausalLM.from_pretrained(path, quant="none", **load)
    model = AutoModelForCausalLM.from_pretrained(path, quant=None if quant == "gguf" else quant, **load)
    fmts = {m.format for m in quantized_modules(model).values()}
    assert fmts == {"gguf_q4_1" if quant == "gguf" else quant}
    prompt = "fp8_scaled_mm" if quant == "fp8" and torch.cuda.get_device_capability() >= (8, 9) else "dequant_mm"
    assert [linear_q_taker(model, m) for m in (1, 8, 256)] == ["gemv_q", "gemm_q", prompt]
    with torch.inference_mode():
        pairs = [(model(w[None].cuda()).logits.argmax(-1), dense(w[None].cuda()).logits.argmax(-1)) for w in windows]
    agree = sum((a == b).sum().item() for a, b in pairs) / sum(b.numel() for _, b in pairs)
    assert agree >= AGREE[quant], (quant, agree)
    base, ppl = perplexity(dense, windows)[0], perplexity(model, windows)[0]
    bound = 0.005 if quant == "gguf" else BOUNDS[quant] + 0.02
    assert abs(ppl / base - 1) < bound, (quant, ppl, base)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 1345, 30]], device="cuda")
    out = model.generate(ids, max_new_tokens=16, ignore_eos=True)
    set_kernels(model, {}, "-linear_q,-swiglu_linear_q,-add_rms_norm_linear_q")
    assert linear_q_taker(model, 1) == "native"
    if quant == "gguf":  # the model's option gguf_a8 (on by default): the GEMV's int8 activations
        emulate_int8_activations_(model)
    with torch.inference_mode():
        again = model(out).logits.argmax(-1)[0, ids.shape[1] - 1 : -1]
    assert (again == out[0, ids.shape[1] :]).sum().item() >= 14, (again, out)
