"""Every registered implementation of every op against the op's native reference.

Runs on CPU (Triton kernels through TRITON_INTERPRET=1, set by conftest when there is no GPU; small shapes) and on
CUDA (``-m cuda``; larger shapes). HPU implementations are tested elsewhere with a test double.

Tolerances (outputs compared with the native reference run in the same dtype; a is ours, b the reference):
  elementwise  |a - b| <= atol + rtol * |b|   and   ||a - b|| / ||b|| <= rel_norm
  float32   atol 1e-5, rtol 1e-4, rel_norm 1e-5 (grads: 1e-4, 1e-3, 1e-4)
  bfloat16  atol 2e-2, rtol 1.6e-2 (two bf16 ulps), rel_norm 8e-3 (grads: 5e-2, 3.2e-2, 1.6e-2)
  float16   atol 2e-3, rtol 2e-3, rel_norm 1e-3 (grads: 5e-3, 4e-3, 2e-3)
The fused kernels round once where the native bf16 path rounds after every op, so they differ by about an ulp.
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from quant_cases import (
    cases_add_rms_norm_linear_q,
    cases_linear_q,
    cases_swiglu_linear_q,
)  # quantized weights: tests/quant_cases.py
from torch.utils._python_dispatch import TorchDispatchMode

from polyfuse.core import registry
from polyfuse.core.context import SelectionContext
from polyfuse.ops.attention import AttentionMeta, cache_mask


HAS_CUDA = torch.cuda.is_available()

TOL = {
    torch.float32: (1e-5, 1e-4, 1e-5),
    torch.bfloat16: (2e-2, 1.6e-2, 8e-3),
    torch.float16: (2e-3, 2e-3, 1e-3),
}
GRAD_TOL = {
    torch.float32: (1e-4, 1e-3, 1e-4),
    torch.bfloat16: (5e-2, 3.2e-2, 1.6e-2),
    torch.float16: (5e-3, 4e-3, 2e-3),
}
# (op, dtype) whose native reference is run on float32 copies of the inputs (results cast back): the native fp16
# cross-entropy scales d logits by 1 / n_valid before casting them to fp16, where they underflow into subnormals
# (rel. error ~5%); the fused kernel scales after the matmuls and is closer to the float32 result.
REF_IN_FLOAT32 = {  # gradients are cast back to the input dtype; the loss stays float32
    ("linear_cross_entropy", torch.float16)
}
# Implementations compared with the float32 reference in every dtype: swiglu_linear's training form rounds
# silu(gate) * up once (the native op rounds silu first): at I = 14336 in bf16 that differs from the low-precision
# reference by more than the bound (seen on an H200), while both are within it of the float32 result.
# The quantized one-row GEMV multiplies the float32 dequantized weight and rounds once; the native reference rounds
# the dequantized weight to the activations' dtype first. At K = 14336 in fp16 (bf16) that rounding alone moves
# outputs by more than the bound (on the GPU and on the CPU: the GEMV matched the float32-weight result to 1e-4
# where the native one sat 2.5e-3 away, as the fp16-weight result does).
REF_IN_FLOAT32_IMPLS = {
    ("swiglu_linear", "triton_recompute"), ("linear_q", "gemv_q"), ("swiglu_linear_q", "gemv_q"),
    ("add_rms_norm_linear_q", "gemv_q"),
}  # fmt: skip
# The int4 GEMM for 2..16 rows (gemm_int4_mma.py: tensor-core products of the packed nibbles, scaled per group in
# float32) does not round the dequantized weight either: the cases it takes (int4 in-order groups, up to 16 rows)
# take the same reference.
REF_IN_FLOAT32_INT4 = {("linear_q", "gemm_q")}


def _int4_mma_takes(make) -> bool:
    from polyfuse.backends.triton.quant import gemm_int4_mma

    (x, qweight, *_), _, _ = make()
    return qweight.format == "int4" and gemm_int4_mma.accepts(x.reshape(-1, x.shape[-1]), None, qweight)


# ... except the SwiGLU GEMV, which rounds silu(gate) * up to the activations' dtype as the unfused path stores it
# (backends/triton/quant/gemv_common.py load_x) and only then multiplies in float32: its reference does the same (the float32
# SwiGLU differs from it by one rounding of each of I = 14336 inputs, which moved 1 of 4096 bf16 outputs of the
# fp8_block case past the bound on an H200; a CPU emulation of the kernel's arithmetic showed the same for
# every format, and none against this reference).
# The weights the GEMV takes after SwiGLU's own kernel instead (gemv_q.paired: int4) get that kernel's rounding:
# silu(gate) * up in float32, rounded once (against the twice-rounded native SwiGLU, 29 of 4096 outputs of the int4
# I = 4096 case were past the bound on an H200).
def _swiglu_rounded_linear_q_f32(gate, up, qweight, bias=None):
    from polyfuse.backends.triton.quant.gemv_q import paired
    from polyfuse.ops.quant_linear import linear_q_native
    from polyfuse.ops.swiglu import swiglu_native

    if paired(qweight):
        h = (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype).float()
    else:
        h = swiglu_native(gate, up).float()
    return linear_q_native(h, qweight, None if bias is None else bias.float()).to(gate.dtype)


# swiglu_linear's training form (triton_recompute) is the same: its SwiGLU pass rounds silu(gate) * up to the inputs'
# dtype once, then the library GEMM multiplies. Against the float32 SwiGLU, that rounding alone puts 6 of the 4096
# bf16 outputs of the I = 14336 case up to 0.25 past the bound (on an H200, and exactly so on the CPU by
# rounding the product and multiplying in float64); against this reference, none. Its gradients too: the
# weight's gradient sums that once-rounded product over the tokens, and against the native bf16 / fp16 SwiGLU (silu
# rounded, then the product) 892 / 1264 of the 131072 weight-gradient elements of the GPU train_halves case were off
# (on an H200, the same counts on the CPU); against this reference (autograd through it), none.
def _swiglu_rounded_linear_f32(gate, up, weight, bias=None):
    h = (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype).float()
    return torch.nn.functional.linear(h, weight.float(), None if bias is None else bias.float()).to(gate.dtype)


# add_rms_norm_linear_q's one-row int4 pair (norm_gemv_q.py) is the norm's kernel, which stores the normalized row in
# the activations' dtype as the native op does, then that GEMV: the same reference, with the native norm in front
# (against the wholly native op, 5-7 of 4096 outputs of the K = 14336 int4 cases were past the bound on an H200:
# the weight's rounding to the activations' dtype, as for linear_q:gemv_q).
def _norm_rounded_linear_q_f32(x, residual, weight, eps, qweight, bias=None):
    from polyfuse.ops.add_rms_norm import add_rms_norm_native
    from polyfuse.ops.quant_linear import linear_q_native
    from polyfuse.ops.rms_norm import rms_norm_native

    if residual is None:
        y, r = rms_norm_native(x, weight, eps), x
    else:
        y, r = add_rms_norm_native(x, residual, weight, eps)
    return linear_q_native(y.float(), qweight, None if bias is None else bias.float()).to(y.dtype), r


# The GGUF one-row GEMVs run on int8 activations (the kernel option gguf_a8, on by default; quant/gemv_gguf_a8.py): their reference
# is the op on the activations the kernel multiplies (quantized in blocks of 32 and back, ops/act_int8.py), in float32
# and rounded once (SwiGLU's product rounded first, the norm native), where that kernel takes the call.
def _a8_linear_q(x, qweight, bias=None):
    from benchmarks.harness.act_int8 import int8_activations
    from polyfuse.ops.quant_linear import linear_q_native

    return linear_q_native(int8_activations(x), qweight, None if bias is None else bias.float()).to(x.dtype)


def _a8_swiglu_linear_q(gate, up, qweight, bias=None):
    return _a8_linear_q((torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype), qweight, bias)


def _a8_add_rms_norm_linear_q(x, residual, weight, eps, qweight, bias=None):
    from polyfuse.ops.add_rms_norm import add_rms_norm_native
    from polyfuse.ops.rms_norm import rms_norm_native

    y, r = (rms_norm_native(x, weight, eps), x) if residual is None else add_rms_norm_native(x, residual, weight, eps)
    return _a8_linear_q(y, qweight, bias), r


# op -> (reference, where the call's activations and packed weight are among its arguments)
A8_REF = {"linear_q": (_a8_linear_q, 0, 1), "swiglu_linear_q": (_a8_swiglu_linear_q, 0, 2),
          "add_rms_norm_linear_q": (_a8_add_rms_norm_linear_q, 0, 4)}  # fmt: skip


def _a8_case(op, impl_name, make) -> bool:
    """Whether gemv_q's call (one row) or gemm_q's (2..MAX_ROWS rows) runs a GGUF GEMV on int8 activations."""
    if impl_name not in ("gemv_q", "gemm_q") or op not in A8_REF:
        return False
    from polyfuse.backends.triton.quant import gemv_gguf_a8

    args, _, _ = make()  # (the default options: gguf_a8 on)
    _, xi, wi = A8_REF[op]
    takes = gemv_gguf_a8.accepts if impl_name == "gemv_q" else gemv_gguf_a8.accepts_rows
    return takes(args[xi], args[wi], args[1] if op == "swiglu_linear_q" else None)


REF_FN = {
    ("swiglu_linear_q", "gemv_q"): _swiglu_rounded_linear_q_f32,
    ("add_rms_norm_linear_q", "gemv_q"): _norm_rounded_linear_q_f32,
    ("swiglu_linear", "triton_recompute"): _swiglu_rounded_linear_f32,
}
# Ops whose reference itself is a long reduction in low precision get looser bounds (factor on the tolerances).
LOOSEN = {
    "attention": 4.0,
    "paged_attention": 4.0,
    "linear_cross_entropy": 2.0,
    "swiglu_linear": 2.0,
    "swiglu_linear_q": 2.0,
}
# float32 ops that sum long rows (K up to 14336) in another order than the library GEMM.
LOOSEN_FP32 = {
    "linear": 4.0,
    "swiglu_linear": 4.0,
    "linear_q": 4.0,
    "swiglu_linear_q": 4.0,
    "add_rms_norm_linear_q": 4.0,
}
# Implementations whose numerics differ from the reference by design: fp8 scaled_mm also quantizes the activations
# to e4m3 per token (~2% relative; tests/test_quantization.py checks it tightly against that arithmetic).
LOOSEN_IMPL = {("linear_q", "scaled_mm"): 8.0, ("linear_q", "fp8_scaled_mm"): 8.0, ("linear_q", "fp8_block_mm"): 8.0,
               ("swiglu_linear_q", "fp8_scaled_mm"): 8.0, ("add_rms_norm_linear_q", "fp8_scaled_mm"): 8.0}  # fmt: skip
# ... and that error is a fraction of the output's scale, not of each element: an output near zero gets an error of
# ~2% of the outputs' rms (at K = 14336 and unit activations about 0.12, beyond any fixed absolute bound). For these
# the absolute bound is at least this fraction of the reference's rms (about 7 standard deviations of that error).
ATOL_OF_RMS = {("linear_q", "scaled_mm"): 0.15, ("linear_q", "fp8_scaled_mm"): 0.15, ("linear_q", "fp8_block_mm"): 0.15,
               ("swiglu_linear_q", "fp8_scaled_mm"): 0.15, ("add_rms_norm_linear_q", "fp8_scaled_mm"): 0.15}  # fmt: skip

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in (torch.float32, torch.bfloat16, torch.float16)]


def _rand(gen, shape, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(device)


# ---- cases: op -> builder(device, dtype, big) -> list of (id, make) where make() -> (args, kwargs, leaves) -------


def _norm_shapes(big):
    return [(64, 4096), (3, 17, 8192), (5, 129)] if big else [(3, 7), (2, 5, 129), (4, 576)]


def _cases_rms_norm(device, dtype, big):
    out = []
    for shape in _norm_shapes(big):
        gen = torch.Generator().manual_seed(hash(shape) % 2**31)
        x0 = _rand(gen, shape, dtype, device, 2.0)
        w0 = _rand(gen, shape[-1:], dtype, device) + 1

        def make(x0=x0, w0=w0):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            return (x, w, 1e-6), {}, [x, w]

        out.append((f"x{list(shape)}", make))
    return out


def _cases_qk_norm(device, dtype, big):
    out = []
    for b, length, hq, hkv, d in [(2, 3, 4, 2, 16)] if not big else [(4, 64, 32, 8, 128)]:
        gen = torch.Generator().manual_seed(b * 131 + d)
        q0, k0 = _rand(gen, (b, length, hq, d), dtype, device, 2.0), _rand(gen, (b, length, hkv, d), dtype, device)
        wq, wk = _rand(gen, (d,), dtype, device) + 1, _rand(gen, (d,), dtype, device) + 1

        def make(q0=q0, k0=k0, wq=wq, wk=wk):
            q, k, a, c = (t.clone().requires_grad_() for t in (q0, k0, wq, wk))
            return (q, k, a, c, 1e-6), {}, [q, k, a, c]

        out.append((f"B{b}L{length}Hq{hq}Hkv{hkv}D{d}", make))
    return out


def _cases_add_rms_norm(device, dtype, big):
    out = []
    for shape in _norm_shapes(big):
        gen = torch.Generator().manual_seed(hash(shape) % 2**31 + 1)
        x0, r0 = _rand(gen, shape, dtype, device), _rand(gen, shape, dtype, device, 3.0)
        w0 = _rand(gen, shape[-1:], dtype, device) + 1

        def make(x0=x0, r0=r0, w0=w0):
            x, r, w = (t.clone().requires_grad_() for t in (x0, r0, w0))
            return (x, r, w, 1e-5), {}, [x, r, w]

        out.append((f"x{list(shape)}", make))
    return out


def _cos_sin(gen, b, length, d, device):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    pos = torch.randint(0, 4096, (b, length), generator=gen).float()
    freqs = pos[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def _cases_rotary(device, dtype, big):
    # (B, Hq, Hkv, L, D, fused): fused -> q/k are strided views of one [B, L, (Hq + 2 Hkv) * D] QKV projection.
    shapes = (
        [(2, 32, 8, 129, 128, True), (4, 32, 8, 1, 128, True), (1, 12, 12, 77, 64, False)]
        if big
        else [(1, 4, 2, 3, 8, False), (2, 3, 1, 5, 16, True), (2, 4, 4, 1, 64, True), (1, 2, 1, 3, 6, False)]
    )
    out = []
    for b, hq, hkv, length, d, fused in shapes:
        gen = torch.Generator().manual_seed(b * 1000 + hq * 100 + length * 10 + d)
        cos, sin = _cos_sin(gen, b, length, d, device)
        if fused:
            qkv0 = _rand(gen, (b, length, (hq + 2 * hkv) * d), dtype, device)

            def make(qkv0=qkv0, b=b, hq=hq, hkv=hkv, length=length, d=d, cos=cos, sin=sin):
                qkv = qkv0.clone().requires_grad_()
                q = qkv[..., : hq * d].view(b, length, hq, d).transpose(1, 2)
                k = qkv[..., hq * d : (hq + hkv) * d].view(b, length, hkv, d).transpose(1, 2)
                return (q, k, cos, sin), {}, [qkv]

        else:
            q0, k0 = _rand(gen, (b, hq, length, d), dtype, device), _rand(gen, (b, hkv, length, d), dtype, device)

            def make(q0=q0, k0=k0, cos=cos, sin=sin):
                q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
                return (q, k, cos, sin), {}, [q, k]

        out.append((f"B{b}Hq{hq}Hkv{hkv}L{length}D{d}{'fused' if fused else ''}", make))
    return out


SMALL_GEMV = {
    "linear": {"40,1030": [8, 256, 4, 1], "40,96": [16, 32, 4, 1]},
    "swiglu_linear": {"20,129": [4, 64, 4, 1]},
}


@pytest.fixture(scope="module")
def run_ctx(tmp_path_factory):
    """The selection context the implementations are bound in: its tile_configs folder adds small shapes to this
    machine's GEMV table (on the CPU an empty one), so the interpreter runs the GEMV's kernel (with masked and
    unmasked K tiles); on a GPU the tuned shapes stay."""
    from polyfuse.backends.triton import tuned

    base = tuned.table("gemv", tuned.gpu_name("cuda") if torch.cuda.is_available() else "")
    folder = tmp_path_factory.mktemp("tile_configs")
    (folder / "gemv").mkdir()
    table = {op: {**base.get(op, {}), **shapes} for op, shapes in SMALL_GEMV.items()}
    (folder / "gemv" / "default.json").write_text(json.dumps(table))
    return SelectionContext(torch.device("cpu"), flags={"tile_configs": str(folder)})


def _cases_linear(device, dtype, big):
    # (x leading dims, K, N): decode rows (<= 4) take the GEMV, more rows the library GEMM; K not a multiple of the
    # GEMV's tile, and x as a strided view (a slice of a wider activation), as the model passes them.
    # One row of a tuned shape takes the GEMV (on the CPU: the small shapes _small_gemv_table adds, the real tables
    # being too slow for the interpreter); more rows go to the library GEMM.
    shapes = [((1, 1), 4096, 4096), ((1, 1), 4096, 6144), ((2, 1), 14336, 4096), ((3, 5), 512, 96)] if big else [
        ((1, 1), 1030, 40), ((1, 1), 96, 40), ((3, 5), 64, 24)]  # fmt: skip
    out = []
    for lead, k, n in shapes:
        gen = torch.Generator().manual_seed(k + n)
        x0 = _rand(gen, (*lead, k + 8), dtype, device)
        w0 = _rand(gen, (n, k), dtype, device, 0.05)

        def make(x0=x0, w0=w0, k=k):
            return (x0[..., :k], w0), {}, []

        out.append((f"x{lead}K{k}N{n}", make))
    return out


def _cases_lora_linear(device, dtype, big):
    # A fused [q; k; v]-like weight with fp32 adapters (PEFT's default for bf16 models) on the first and last row
    # ranges, no dropout (deterministic); gradients for x and every adapter weight.
    k, rows, r = (4096, (4096, 1024, 1024), 16) if big else (64, (32, 16, 16), 4)
    n = sum(rows)
    gen = torch.Generator().manual_seed(k + n)
    x0 = _rand(gen, (2, 5, k), dtype, device)
    w0 = _rand(gen, (n, k), dtype, device, 0.05)
    ab0 = [(_rand(gen, (r, k), torch.float32, device, 0.05), _rand(gen, (m, r), torch.float32, device, 0.05))
           for m in (rows[0], rows[2])]  # fmt: skip

    def make():
        from polyfuse.ops.lora_linear import LoraAdapter

        x = x0.clone().requires_grad_()
        ab = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in ab0]
        adapters = (LoraAdapter(0, rows[0], *ab[0], 2.0), LoraAdapter(n - rows[2], n, *ab[1], 0.5))
        return (x, w0, None, adapters), {}, [x, *ab[0], *ab[1]]

    return [(f"K{k}N{n}r{r}", make)]


def _cases_swiglu_linear(device, dtype, big):
    # gate/up: halves of one fused [.., 2I] projection, as the model passes them.
    # One row of a tuned shape: SwiGLU inside the GEMV; the others take SwiGLU + the library GEMM.
    shapes = [((1, 1), 14336, 4096), ((9,), 256, 64)] if big else [((1, 1), 129, 20), ((2, 1), 1024, 16)]
    out = []
    for lead, i, n in shapes:
        gen = torch.Generator().manual_seed(i + n)
        gu0 = _rand(gen, (*lead, 2 * i), dtype, device, 2.0)
        w0 = _rand(gen, (n, i), dtype, device, 0.05)

        def make(gu0=gu0, w0=w0, i=i):
            return (gu0[..., :i], gu0[..., i:], w0), {}, []

        out.append((f"x{lead}I{i}N{n}", make))
    # Training (gradients): gate/up as the halves of a projection's output (an intermediate, as in the decoder), and
    # as two separate leaf tensors, with a bias.
    lead, i, n = ((4, 64), 512, 256) if big else ((2, 3), 24, 16)
    gen = torch.Generator().manual_seed(77)
    gu0, w0, b0 = _rand(gen, (*lead, 2 * i), dtype, device, 2.0), _rand(gen, (n, i), dtype, device, 0.05), None
    b0 = _rand(gen, (n,), dtype, device)

    def make_halves(gu0=gu0, w0=w0, i=i):
        gu_leaf, w = gu0.clone().requires_grad_(), w0.clone().requires_grad_()
        gu = gu_leaf * 1.0  # an intermediate result, like the gate/up projection's output
        return (gu[..., :i], gu[..., i:], w), {}, [gu_leaf, w]

    def make_pair(gu0=gu0, w0=w0, b0=b0, i=i):
        g, u = gu0[..., :i].clone().requires_grad_(), gu0[..., i:].clone().requires_grad_()
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        return (g, u, w, b), {}, [g, u, w, b]

    out += [("train_halves", make_halves), ("train_pair_bias", make_pair)]
    return out


def _cases_swiglu(device, dtype, big):
    # (leading dims, I, fused): fused -> gate/up are the two halves of one [.., 2I] projection (strided rows).
    shapes = (
        [((4, 100), 11008, True), ((7,), 14336, False)]
        if big
        else [((3,), 7, False), ((2, 3), 129, True), ((5,), 576, True)]
    )
    out = []
    for lead, i, fused in shapes:
        gen = torch.Generator().manual_seed(i)
        if fused:
            gu0 = _rand(gen, (*lead, 2 * i), dtype, device, 2.0)

            def make(gu0=gu0, i=i):
                gu = gu0.clone().requires_grad_()
                return (gu[..., :i], gu[..., i:]), {}, [gu]

        else:
            g0, u0 = _rand(gen, (*lead, i), dtype, device, 2.0), _rand(gen, (*lead, i), dtype, device)

            def make(g0=g0, u0=u0):
                g, u = g0.clone().requires_grad_(), u0.clone().requires_grad_()
                return (g, u), {}, [g, u]

        out.append((f"{list(lead)}x{i}{'fused' if fused else ''}", make))
    return out


def _cases_linear_cross_entropy(device, dtype, big):
    shapes = [(1000, 512, 32000), (77, 1024, 4099)] if big else [(7, 16, 33), (13, 8, 129)]
    out = []
    for n, h, v in shapes:
        gen = torch.Generator().manual_seed(n + h + v)
        h0 = _rand(gen, (n, h), dtype, device)
        w0 = _rand(gen, (v, h), dtype, device, 1.0 / math.sqrt(h))
        labels = torch.randint(0, v, (n,), generator=gen)
        labels[:: max(2, n // 3)] = -100
        labels = labels.to(device)
        for reduction in ("mean", "sum"):

            def make(h0=h0, w0=w0, labels=labels, reduction=reduction):
                hid, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
                return (hid, w, labels), {"ignore_index": -100, "reduction": reduction}, [hid, w]

            out.append((f"N{n}H{h}V{v}-{reduction}", make))
    return out


def _pad_mask(lengths, lq, lk, dtype, device, causal):
    """Additive [B, 1, Lq, Lk] mask for left padding (lengths real tokens at the end of each row)."""
    b = len(lengths)
    keep = torch.zeros(b, 1, lq, lk, dtype=torch.bool)
    for i, n in enumerate(lengths):
        keep[i, :, :, lk - n :] = True
    if causal:
        q_pos = torch.arange(lk - lq, lk)[:, None]
        keep &= torch.arange(lk)[None, :] <= q_pos
        # Padding queries would have no key at all; let them see themselves, so every row is well defined
        # (fully masked rows are garbage in every implementation, and their gradients differ).
        keep |= torch.arange(lk)[None, :] == q_pos
    mask = torch.zeros(b, 1, lq, lk, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    return mask.to(device)


def _second_split_start(device, b, hkv, lk, d) -> int:
    """The first key of the decode attention's second split for this cache (the slot where one key more than the
    first split's is live: an off-by-one in the live splits drops it)."""
    from polyfuse.backends.triton import decode_attention as da

    long = lk >= da.LONG and d <= 128
    block = da.LONG_TILE[0] if long else (da.TILE[0] if d <= 128 else 32)
    n, split_len = da._n_splits(torch.device(device), b, hkv, lk, block, da.LONG_PER_SM if long else da.PER_SM)
    assert n > 1, (lk, n)
    return split_len


def _cases_attention(device, dtype, big):
    # (B, Hq, Hkv, Lq, Lk, D, kind) kind: causal (no mask), masked (left padding), decode (Lq=1, mask), full
    shapes = (
        [
            (2, 32, 8, 257, 257, 128, "causal"),
            (3, 32, 8, 100, 100, 128, "masked"),
            (4, 32, 8, 1, 1000, 128, "decode"),
            (2, 16, 16, 1, 300, 64, "decode"),
            (3, 32, 8, 1, 640, 128, "decode_keys"),
            (1, 32, 8, 1, 8192, 128, "decode_keys"),
            (1, 32, 8, 1, 8192, 128, "decode_keys_early"),
            (1, 32, 8, 1, 4096, 128, "decode_keys_boundary"),
        ]
        if big
        else [
            (2, 4, 2, 5, 5, 16, "causal"),
            (1, 4, 4, 3, 7, 8, "causal"),
            (2, 4, 1, 6, 6, 16, "masked"),
            (2, 8, 2, 1, 9, 16, "decode"),
            (1, 4, 1, 1, 150, 24, "decode"),
            (3, 8, 2, 1, 200, 16, "decode_keys"),
            (2, 4, 2, 1, 2100, 16, "decode_keys"),  # from decode_attention.LONG keys on: the long tile
            (1, 4, 2, 1, 2100, 16, "decode_keys_early"),  # the slot early in a long cache: most splits hold no key
            (1, 2, 1, 1, 512, 16, "decode_keys_boundary"),  # the slot on a split's first key: that split is live
            (1, 2, 2, 4, 4, 8, "full"),
        ]
    )
    out = []
    for b, hq, hkv, lq, lk, d, kind in shapes:
        gen = torch.Generator().manual_seed(b + hq + lq * 7 + lk * 13 + d)
        q0, k0, v0 = (_rand(gen, (b, h, length, d), dtype, device) for h, length in ((hq, lq), (hkv, lk), (hkv, lk)))
        lengths = [lk - (i * 2) % lk for i in range(b)]
        mask = None
        if kind == "masked":
            mask = _pad_mask(lengths, lq, lk, dtype, device, causal=True)
        elif kind == "decode":
            mask = _pad_mask(lengths, 1, lk, dtype, device, causal=False)
        meta = AttentionMeta(
            scale=d**-0.5,
            mask=mask,
            is_causal=kind == "causal",
            decode=kind.startswith("decode"),
            valid_lengths=torch.tensor(lengths, dtype=torch.int32, device=device),
        )
        if kind.startswith("decode_keys"):
            # As the model passes a decode step: a bool key mask wider than the KV bucket (left padding) and the
            # query's cache slot inside the bucket, so keys after it are hidden; the additive mask is built lazily.
            key_mask = torch.ones(b, lk + 5, dtype=torch.bool, device=device)
            for i in range(b):
                key_mask[i, : i * 3] = False
            if kind.endswith("early"):
                at = lk // 20
            elif kind.endswith("boundary"):
                at = _second_split_start(device, b, hkv, lk, d)
            else:
                at = lk - 1 - lk // 5
            slot = torch.tensor([at], device=device)
            meta.key_mask, meta.cache_position = key_mask[:, :lk], slot
            meta.lazy_mask = lambda km=key_mask, p=slot, n=lk: cache_mask(km, p, n, dtype)

        def make(q0=q0, k0=k0, v0=v0, meta=meta):
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            return (q, k, v, meta), {}, [q, k, v]

        out.append((f"{kind}-B{b}Hq{hq}Hkv{hkv}Lq{lq}Lk{lk}D{d}", make))
    return out


def _cases_rotary_kv_write(device, dtype, big):
    # (B, Hq, Hkv, L, D, cache length, first position): q/k/v are views of one fused QKV projection, as in the model.
    shapes = [(2, 32, 8, 1, 128, 300, 211), (2, 8, 8, 17, 64, 40, 3)] if big else [(2, 6, 2, 3, 16, 10, 4)]
    out = []
    for b, hq, hkv, length, d, s_len, p0 in shapes:
        gen = torch.Generator().manual_seed(b + hq + length + d)
        cos, sin = _cos_sin(gen, b, length, d, device)
        qkv0 = _rand(gen, (b, length, (hq + 2 * hkv) * d), dtype, device)
        pos = torch.arange(p0, p0 + length, device=device)

        def make(qkv0=qkv0, b=b, hq=hq, hkv=hkv, length=length, d=d, cos=cos, sin=sin, pos=pos, s_len=s_len):
            qkv = qkv0.clone()
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = (t.view(b, length, -1, d).transpose(1, 2) for t in (q, k, v))
            kc = torch.full((b, hkv, s_len, d), float("nan"), dtype=dtype, device=device)
            return (q, k, v, cos, sin, kc, kc.clone(), pos), {}, []

        out.append((f"B{b}Hq{hq}Hkv{hkv}L{length}D{d}S{s_len}", make))
    return out


def _paged_case(gen, device, dtype, seqs, hq, hkv, d, block_size, extra_blocks=2, window=None):
    """A paged cache whose blocks are handed out in a shuffled order, and the meta of ``seqs``: [(keys before this
    step, queries this step)] (one query each: a decode meta; else a prefill chunk per sequence)."""
    from polyfuse.ops.paged_attention import PagedMeta

    need = [-(-(start + n) // block_size) for start, n in seqs]
    n_blocks = sum(need) + 1 + extra_blocks
    order = torch.randperm(n_blocks - 1, generator=gen) + 1  # block 0: the padding block
    width = max(need) + extra_blocks  # wider than any sequence needs, as a graph's table is
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    taken = 0
    for s, k in enumerate(need):
        tables[s, :k] = order[taken : taken + k].to(torch.int32)
        taken += k
    kc = _rand(gen, (n_blocks, block_size, hkv, d), dtype, device)
    vc = _rand(gen, (n_blocks, block_size, hkv, d), dtype, device)
    lens = torch.tensor([start + n for start, n in seqs], dtype=torch.int32)
    q_max = max(n for _, n in seqs)
    qi = torch.zeros(len(seqs), q_max, dtype=torch.long)
    qp = torch.zeros(len(seqs), q_max, dtype=torch.long)
    out, row = [], 0
    for s, (start, n) in enumerate(seqs):
        qi[s] = row
        qi[s, :n] = torch.arange(row, row + n)
        qp[s, :n] = torch.arange(start, start + n)
        out += [s * q_max + i for i in range(n)]
        row += n
    q0 = _rand(gen, (row, hq, d), dtype, device)
    decode = q_max == 1
    meta = PagedMeta(tables.to(device), lens.to(device), qi.to(device), qp.to(device),
                     torch.tensor(out, device=device), d**-0.5, decode=decode, window=window)  # fmt: skip
    return q0, kc, vc, meta


def _cases_paged_attention(device, dtype, big):
    # (sequences [(keys before, queries)], Hq, Hkv, D, block size, window)
    shapes = (
        [
            ([(i * 37 % 1900 + 1, 1) for i in range(64)], 32, 8, 128, 16, None),
            ([(4095, 1)], 32, 8, 128, 16, None),  # one long sequence: many splits
            ([(700, 1), (3, 1), (1500, 1)], 32, 8, 128, 16, 256),
            ([(0, 300), (512, 77), (33, 1)], 32, 8, 128, 16, None),  # prefill chunks, one after a cached prefix
        ]
        if big
        else [
            ([(0, 1), (5, 1), (40, 1)], 4, 2, 16, 4, None),  # decode, GQA, tiny blocks
            ([(130, 1), (7, 1)], 4, 1, 24, 16, None),  # D not a power of two, MQA
            ([(200, 1)], 2, 2, 16, 8, None),  # splits on the interpreter's 2 "multiprocessors"
            ([(50, 1), (9, 1)], 4, 2, 16, 4, 8),  # sliding window
            ([(0, 6), (8, 3), (5, 1)], 4, 2, 16, 4, None),  # prefill chunks: one fresh, one after a prefix
            ([(0, 70), (100, 5), (3, 1)], 4, 2, 16, 16, 20),  # two query tiles, a window, a long cached prefix
        ]
    )
    out = []
    for seqs, hq, hkv, d, block_size, window in shapes:
        gen = torch.Generator().manual_seed(len(seqs) * 31 + hq + d + block_size)
        q0, kc, vc, meta = _paged_case(gen, device, dtype, seqs, hq, hkv, d, block_size, window=window)
        kind = "decode" if meta.decode else "prefill"

        def make(q0=q0, kc=kc, vc=vc, meta=meta):
            return (q0.clone(), kc, vc, meta), {}, []

        out.append((f"{kind}-S{len(seqs)}Hq{hq}Hkv{hkv}D{d}B{block_size}W{window}", make))
    return out


def _cases_all_reduce(device, dtype, big):
    # One process: no group, the sum over one rank is the tensor itself (tests/test_tensor_parallel.py runs 2 ranks).
    gen = torch.Generator().manual_seed(11)
    x0 = _rand(gen, (2, 3, 64), dtype, device)
    return [("x[2,3,64]-single", lambda: ((x0.clone(), None), {}, []))]


# Ops with side effects: what to compare besides the return value (the written cache slots, and that the rest of
# each cache is untouched, still NaN).
SIDE_OUTPUTS = {
    "rotary_kv_write": lambda args: (
        args[5].index_select(2, args[7]),
        args[6].index_select(2, args[7]),
        torch.isnan(args[5]).sum(-1).to(args[5].dtype),
    ),
}


CASES = {
    "all_reduce": _cases_all_reduce,
    "rotary_kv_write": _cases_rotary_kv_write,
    "rms_norm": _cases_rms_norm,
    "qk_norm": _cases_qk_norm,
    "add_rms_norm": _cases_add_rms_norm,
    "rotary": _cases_rotary,
    "swiglu": _cases_swiglu,
    "linear_cross_entropy": _cases_linear_cross_entropy,
    "attention": _cases_attention,
    "paged_attention": _cases_paged_attention,
    "linear": _cases_linear,
    "lora_linear": _cases_lora_linear,
    "swiglu_linear": _cases_swiglu_linear,
    "linear_q": cases_linear_q,
    "swiglu_linear_q": cases_swiglu_linear_q,
    "add_rms_norm_linear_q": cases_add_rms_norm_linear_q,
}


def _impl_params():
    params = []
    for op in registry.ops():
        for impl in registry.implementations(op):
            if impl.devices == ("hpu",):
                continue  # tested with a test double elsewhere
            params.append(pytest.param(op, impl.name, id=f"{op}:{impl.name}"))
    return params


def test_every_op_has_cases():
    assert set(registry.ops()) <= set(CASES), "add conformance cases for new ops"


# ---- comparison ---------------------------------------------------------------------------------------------------


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def assert_close(actual, expected, tol, what, loosen=1.0, atol_of_rms=0.0):
    atol, rtol, rel_norm = (t * loosen for t in tol)
    if atol_of_rms:
        atol = max(atol, atol_of_rms * expected.detach().double().pow(2).mean().sqrt().item())
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert torch.isfinite(a).all() == torch.isfinite(b).all(), f"{what}: non-finite values differ"
    err = (a - b).abs()
    max_abs = err.max().item() if err.numel() else 0.0
    bad = err > atol + rtol * b.abs()
    norm = (a - b).norm().item() / max(b.norm().item(), 1e-30)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off, max abs err {max_abs:.3g} (atol {atol}, rtol {rtol})"
    )
    assert norm <= rel_norm, f"{what}: relative norm err {norm:.3g} > {rel_norm} (max abs {max_abs:.3g})"


class Poison:
    """Fills every torch.empty / empty_like / new_empty float buffer with NaN while active, so a kernel that leaves
    part of a preallocated output unwritten fails the comparison."""

    def __init__(self, monkeypatch):
        for name in ("empty", "empty_like"):
            real = getattr(torch, name)

            def poisoned(*args, _real=real, **kwargs):
                t = _real(*args, **kwargs)
                if t.is_floating_point():
                    t.fill_(float("nan"))
                return t

            monkeypatch.setattr(torch, name, poisoned)


def _cotangents(outs, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device) for o in outs]


def _upcast(make):
    def make32():
        args, kwargs, leaves = make()
        if not leaves:  # forward-only cases: every floating input
            up = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
            return up, kwargs, []
        new = {id(t): t.detach().float().requires_grad_(t.requires_grad) for t in leaves}
        args = tuple(new.get(id(a), a) for a in args)
        return args, kwargs, [new[id(t)] for t in leaves]

    return make32


def _run(fn, make, backward, cast_to=None, side=None):
    args, kwargs, leaves = make()
    backward = backward and bool(leaves)
    with torch.set_grad_enabled(backward):
        outs = _as_tuple(fn(*args, **kwargs))
    if side is not None:
        outs = outs + tuple(side(args))
    grads = None
    if backward:
        cts = _cotangents(outs, 1234)
        grads = torch.autograd.grad(outs, leaves, cts, allow_unused=True)
    if cast_to is not None:
        grads = grads and tuple(g.to(cast_to) if g is not None else None for g in grads)
    return outs, grads


def _check_impl(op, impl_name, device, dtype, monkeypatch, ctx):
    if device == "cpu" and op == "attention" and dtype == torch.float16:
        pytest.skip("CPU SDPA/matmul in float16 is too slow/unsupported to be meaningful")
    if device == "cpu" and impl_name in ("scaled_mm", "fp8_scaled_mm"):
        from helpers import cpu_scaled_mm_missing

        if cpu_scaled_mm_missing():
            pytest.skip(cpu_scaled_mm_missing())
    spec = registry.ops()[op]
    impl = next(i for i in registry.implementations(op) if i.name == impl_name)
    loosen = LOOSEN.get(op, 1.0) if dtype != torch.float32 else LOOSEN_FP32.get(op, 1.0)
    loosen *= LOOSEN_IMPL.get((op, impl_name), 1.0)
    big = device == "cuda"
    side = SIDE_OUTPUTS.get(op)
    for case_id, make in CASES[op](device, dtype, big):
        upcast = (op, dtype) in REF_IN_FLOAT32 or ((op, impl_name) in REF_IN_FLOAT32_IMPLS and dtype != torch.float32)
        if (op, impl_name) in REF_IN_FLOAT32_INT4 and dtype != torch.float32 and not upcast:
            upcast = _int4_mma_takes(make)
        if upcast and case_id.startswith("train"):  # gradient cases keep their low-precision reference, except
            upcast = (op, dtype) in REF_IN_FLOAT32 or (op, impl_name) in REF_FN  # where REF_FN is the arithmetic
        if upcast and (op, dtype) not in REF_IN_FLOAT32 and impl.accepts is not None:
            args, kwargs, _ = make()  # a case the implementation declines runs the native op in the inputs' dtype
            kwargs = {**kwargs, "options": ctx.options} if impl.options else kwargs
            upcast = impl.accepts(*args, **kwargs) is None
        if _a8_case(op, impl_name, make):
            ref_outs, ref_grads = _run(A8_REF[op][0], make, impl.supports_backward, side=side)
        elif upcast and (op, impl_name) in REF_FN:
            ref_outs, ref_grads = _run(REF_FN[op, impl_name], make, impl.supports_backward, side=side)
        elif upcast and impl.name != registry.NATIVE:
            ref_outs, ref_grads = _run(spec.native, _upcast(make), impl.supports_backward, dtype, side)
            if (op, dtype) not in REF_IN_FLOAT32:  # the float32 result rounded once to the inputs' dtype
                ref_outs = tuple(o.to(dtype) for o in ref_outs)
        else:
            ref_outs, ref_grads = _run(spec.native, make, impl.supports_backward, side=side)
        with monkeypatch.context() as m:
            if impl.name != registry.NATIVE:
                Poison(m)
            outs, grads = _run(registry.bound(op, impl_name, ctx), make, impl.supports_backward, side=side)
        assert len(outs) == len(ref_outs), f"{case_id}: {len(outs)} outputs, reference has {len(ref_outs)}"
        for i, (o, r) in enumerate(zip(outs, ref_outs)):
            assert o.device == r.device
            assert_close(o, r, TOL[dtype], f"{op}:{impl_name} {case_id} output {i}", loosen,
                         ATOL_OF_RMS.get((op, impl_name), 0.0))  # fmt: skip
        if impl.supports_backward and grads is not None:
            for i, (g, rg) in enumerate(zip(grads, ref_grads)):
                assert (g is None) == (rg is None), f"{case_id}: gradient {i} presence differs"
                if g is not None:
                    assert_close(g, rg, GRAD_TOL[dtype], f"{op}:{impl_name} {case_id} grad {i}", loosen)


# The quantized GEMVs and dequantize-matmul take 3-15 s a case in the Triton interpreter: `make test-all` runs them.
SLOW_PARAMS = (":gemv_q-", ":dequant_mm-", "add_rms_norm_linear_q:native-")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,impl_name", _impl_params())
def test_conformance(op, impl_name, device, dtype, monkeypatch, run_ctx):
    _check_impl(op, impl_name, device, dtype, monkeypatch, run_ctx)


# ---- targeted tests -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_recompute_weight_gradient_needs_the_once_rounded_reference():
    """The GPU train_halves case of swiglu_linear:triton_recompute (256 tokens, I = 512) on the CPU in bfloat16: its
    gradients are within the bound of the once-rounded SwiGLU reference (REF_FN, what the conformance suite uses)
    and the weight's gradient is not within it of the native bf16 SwiGLU's (892 elements, as on an H200, here
    with torch 2.13): the reference choice is what the GPU case turns on."""
    make = dict(_cases_swiglu_linear("cpu", torch.bfloat16, True))["train_halves"]
    _, grads = _run(registry.bound("swiglu_linear", "triton_recompute"), make, True)
    _, ref = _run(REF_FN["swiglu_linear", "triton_recompute"], make, True)
    _, native = _run(registry.ops()["swiglu_linear"].native, make, True)
    for i, (g, r) in enumerate(zip(grads, ref)):
        assert_close(g, r, GRAD_TOL[torch.bfloat16], f"grad {i}", LOOSEN["swiglu_linear"])
    with pytest.raises(AssertionError, match="elements off"):
        assert_close(grads[1], native[1], GRAD_TOL[torch.bfloat16], "grad 1", LOOSEN["swiglu_linear"])


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_at_least_as_accurate_as_native_bf16(device):
    from polyfuse.backends.triton.rotary import rotary
    from polyfuse.ops.rotary import rotary_native

    b, hq, hkv, length, d = (2, 8, 2, 33, 128) if device == "cuda" else (1, 4, 2, 9, 64)
    gen = torch.Generator().manual_seed(7)
    q = _rand(gen, (b, hq, length, d), torch.bfloat16, device)
    k = _rand(gen, (b, hkv, length, d), torch.bfloat16, device)
    cos, sin = _cos_sin(gen, b, length, d, device)
    ref_q, ref_k = rotary_native(q.double(), k.double(), cos.double(), sin.double())
    nat_q, nat_k = rotary_native(q, k, cos, sin)
    tri_q, tri_k = rotary(q, k, cos, sin)
    for tri, nat, ref in ((tri_q, nat_q, ref_q), (tri_k, nat_k, ref_k)):
        e_tri, e_nat = (tri.double() - ref).abs(), (nat.double() - ref).abs()
        assert e_tri.max() <= e_nat.max(), (e_tri.max().item(), e_nat.max().item())
        assert e_tri.mean() <= e_nat.mean(), (e_tri.mean().item(), e_nat.mean().item())


def test_rotary_returns_new_tensors():
    from polyfuse.backends.triton.rotary import rotary

    gen = torch.Generator().manual_seed(3)
    q, k = _rand(gen, (1, 2, 3, 8), torch.float32, "cpu"), _rand(gen, (1, 1, 3, 8), torch.float32, "cpu")
    q0, k0 = q.clone(), k.clone()
    cos, sin = _cos_sin(gen, 1, 3, 8, "cpu")
    qo, ko = rotary(q, k, cos, sin)
    assert qo.data_ptr() != q.data_ptr() and ko.data_ptr() != k.data_ptr()
    assert torch.equal(q, q0) and torch.equal(k, k0)


class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_chunk_rows_keeps_logits_chunk_near_hidden_size():
    from polyfuse.backends.triton.linear_cross_entropy import chunk_rows

    for n, h, v in ((8192, 4096, 128256), (16384, 2048, 32000), (3, 4096, 128256), (100, 64, 50), (1, 8, 8)):
        c = chunk_rows(n, h, v)
        assert 1 <= c <= n
        if v > h:
            assert c < n or n == 1, (n, h, v, c)
            assert c * v <= 2 * n * h + v, (n, h, v, c)  # one chunk of logits ~ the size of hidden
    # On GPUs a floor keeps chunks large enough that the GEMMs are not memory-bound, still below N for long inputs.
    assert chunk_rows(2048, 2048, 128256, 1024) == 1024
    assert chunk_rows(16384, 4096, 128256, 1024) == 1024
    assert chunk_rows(512, 2048, 128256, 1024) == 512


@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_never_holds_full_logits(device):
    from polyfuse.backends.triton.linear_cross_entropy import MIN_CHUNK_ROWS, chunk_rows, linear_cross_entropy
    from polyfuse.ops.linear_cross_entropy import linear_cross_entropy_native

    n, h, v = (64, 8, 257) if device == "cpu" else (4096, 256, 32000)
    gen = torch.Generator().manual_seed(11)
    hid0 = _rand(gen, (n, h), torch.float32, device)
    w0 = _rand(gen, (v, h), torch.float32, device, 0.3)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::5] = -100
    labels = labels.to(device)
    assert chunk_rows(n, h, v, MIN_CHUNK_ROWS if device == "cuda" else 1) < n
    hid, w = hid0.clone().requires_grad_(), w0.clone().requires_grad_()
    with _MaxNumel() as mode:
        loss = linear_cross_entropy(hid, w, labels)
        loss.backward()
    assert mode.max_numel < n * v, f"a tensor of {mode.max_numel} elements >= N*V = {n * v}"
    hid_r, w_r = hid0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = linear_cross_entropy_native(hid_r, w_r, labels)
    ref.backward()
    assert_close(loss, ref, TOL[torch.float32], "loss")
    assert_close(hid.grad, hid_r.grad, GRAD_TOL[torch.float32], "grad hidden")
    assert_close(w.grad, w_r.grad, GRAD_TOL[torch.float32], "grad weight")


def test_linear_cross_entropy_explicit_chunks_and_grad_output():
    from polyfuse.backends.triton.linear_cross_entropy import linear_cross_entropy
    from polyfuse.ops.linear_cross_entropy import linear_cross_entropy_native

    gen = torch.Generator().manual_seed(5)
    hid0, w0 = _rand(gen, (10, 12), torch.float32, "cpu"), _rand(gen, (37, 12), torch.float32, "cpu")
    labels = torch.randint(0, 37, (10,), generator=gen)
    labels[2] = -1
    for chunk in (1, 3, 10):
        hid, w = hid0.clone().requires_grad_(), w0.clone().requires_grad_()
        (linear_cross_entropy(hid, w, labels, ignore_index=-1, reduction="sum", chunk=chunk) * 0.5).backward()
        hid_r, w_r = hid0.clone().requires_grad_(), w0.clone().requires_grad_()
        (linear_cross_entropy_native(hid_r, w_r, labels, ignore_index=-1, reduction="sum") * 0.5).backward()
        assert_close(hid.grad, hid_r.grad, GRAD_TOL[torch.float32], f"grad hidden chunk={chunk}")
        assert_close(w.grad, w_r.grad, GRAD_TOL[torch.float32], f"grad weight chunk={chunk}")


def test_rotary_kv_write_falls_back_with_one_warning_on_a_cache_it_cannot_take(caplog):
    """A cache whose head dim is not contiguous (a layout the kernel does not write): the native op runs, same
    result, one warning however many calls."""
    import logging

    from polyfuse.ops.rotary_kv_write import rotary_kv_write_native

    rotary_kv_write = registry.bound("rotary_kv_write", "triton")

    gen = torch.Generator().manual_seed(5)
    q, k, v = (_rand(gen, (1, h, 2, 8), torch.bfloat16, "cpu") for h in (4, 2, 2))
    cos, sin = _cos_sin(gen, 1, 2, 8, "cpu")
    pos = torch.tensor([3, 4])
    caches = [torch.zeros(1, 2, 8, 6, dtype=torch.bfloat16).transpose(2, 3) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="polyfuse"):
        for _ in range(3):
            got = rotary_kv_write(q, k, v, cos, sin, caches[0], caches[1], pos)
    want = rotary_kv_write_native(q, k, v, cos, sin, caches[2], caches[3], pos)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert len(caplog.records) == 1 and "not contiguous" in caplog.records[0].getMessage()


def test_gemv_runs_on_tuned_shapes_only(monkeypatch, tmp_path):
    """The linear ops' tuned GEMV must really take the GEMV on its tuned shapes (and only there): the shapes of a
    run's tile_configs table."""
    pytest.importorskip("triton")
    from polyfuse.backends.triton import gemv as kernel

    calls = []
    real = kernel.gemv
    monkeypatch.setattr(kernel, "gemv", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    (tmp_path / "gemv").mkdir()
    table = {"linear": {"24,40": [8, 16, 4, 1]}, "swiglu_linear": {"24,40": [16, 32, 4, 1]}}
    (tmp_path / "gemv" / "default.json").write_text(json.dumps(table))
    ctx = SelectionContext(torch.device("cpu"), flags={"tile_configs": str(tmp_path)})
    g = SimpleNamespace(linear=registry.bound("linear", "triton_gemv", ctx),
                        swiglu_linear=registry.bound("swiglu_linear", "triton_gemv", ctx))  # fmt: skip
    assert registry.bound("linear", "triton_gemv")(torch.randn(1, 40), torch.randn(24, 40)) is not None
    assert calls == []  # without the table: the shape is not tuned for this machine, F.linear ran
    gen = torch.Generator().manual_seed(0)
    x, up, w = (
        torch.randn(1, 1, 40, generator=gen),
        torch.randn(1, 1, 40, generator=gen),
        torch.randn(24, 40, generator=gen),
    )
    torch.testing.assert_close(g.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    ref = torch.nn.functional.silu(x) * up @ w.T
    torch.testing.assert_close(g.swiglu_linear(x, up, w), ref, rtol=1e-5, atol=1e-5)
    assert calls == [(24, 40), (24, 40)]
    x2 = torch.randn(2, 1, 40, generator=gen)  # two rows: library path
    torch.testing.assert_close(g.linear(x2, w), x2 @ w.T, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2


def test_swiglu_on_halves_of_one_projection_writes_one_gradient(monkeypatch):
    """gate/up as the halves of one projection: the autograd node takes the projection itself (no zero-filled
    halves summed by autograd), and the gradient equals the native one."""
    pytest.importorskip("triton")
    from polyfuse.backends.triton import swiglu as sw

    taken = []
    real = sw._SwiGLUHalves.apply
    monkeypatch.setattr(sw._SwiGLUHalves, "apply", lambda x: taken.append(x.shape) or real(x))
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(2 * 24, 16, generator=gen).requires_grad_()
    x = torch.randn(2, 5, 16, generator=gen)
    gu = torch.nn.functional.linear(x, w)
    y = sw.swiglu(gu[..., :24], gu[..., 24:])
    cot = torch.randn(y.shape, generator=gen)
    (gw,) = torch.autograd.grad((y * cot).sum(), w)
    gu = torch.nn.functional.linear(x, w)
    (ref,) = torch.autograd.grad(((torch.nn.functional.silu(gu[..., :24]) * gu[..., 24:]) * cot).sum(), w)
    assert taken == [(2, 5, 48)]
    torch.testing.assert_close(gw, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["halves", "two_projections"])
def test_swiglu_backward_writes_gradients_over_its_saved_inputs(fused):
    """Liger's memory trick (issue 13): the SwiGLU backward writes d(gate), d(up) over the saved gate/up (outputs of
    the projections, which nothing else keeps), so no new [..., 2I] buffer exists at the MLP backward's peak; the
    gradients still equal the native ones, and a caller's own leaf tensors are never overwritten."""
    pytest.importorskip("triton")
    from polyfuse.backends.triton import swiglu as sw

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 7, 16, generator=gen)
    wg, wu = (torch.randn(24, 16, generator=gen).requires_grad_() for _ in range(2))
    cot = torch.randn(3, 7, 24, generator=gen)
    seen = []

    def projections():
        if fused:
            gu = torch.nn.functional.linear(x, torch.cat([wg, wu]))
            gu.register_hook(lambda g: seen.append(g.data_ptr() == gu.data_ptr()))
            return gu[..., :24], gu[..., 24:]
        g, u = torch.nn.functional.linear(x, wg), torch.nn.functional.linear(x, wu)
        g.register_hook(lambda d: seen.append(d.data_ptr() == g.data_ptr()))
        return g, u

    got = torch.autograd.grad((sw.swiglu(*projections()) * cot).sum(), (wg, wu))
    gate, up = projections()
    ref = torch.autograd.grad(((torch.nn.functional.silu(gate) * up) * cot).sum(), (wg, wu))
    assert seen[0] is True, "the gradient was written to a new buffer, not over the saved projection"
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Leaves: the caller's tensors keep their values.
    g0, u0 = (torch.randn(4, 24, generator=gen).requires_grad_() for _ in range(2))
    keep = (g0.detach().clone(), u0.detach().clone())
    sw.swiglu(g0, u0).sum().backward()
    assert torch.equal(g0.detach(), keep[0]) and torch.equal(u0.detach(), keep[1])
    shared = torch.randn(4, 24, generator=gen).requires_grad_()
    h = shared * 1.0  # not a leaf: swiglu(h, h) must not write both gradients into h
    (gs,) = torch.autograd.grad(sw.swiglu(h, h).sum(), shared)
    ref_s = torch.autograd.grad((torch.nn.functional.silu(shared) * shared).sum(), shared)[0]
    torch.testing.assert_close(gs, ref_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["views_of_qkv", "two_projections"])
def test_rotary_writes_over_projection_outputs_and_keeps_gradients(fused):
    """Liger's RoPE trick (issue 13): q and k made by a differentiable projection are rotated where they are (no
    second copy while attention holds them), with the native gradients; a caller's own tensors are left alone."""
    pytest.importorskip("triton")
    from polyfuse.backends.triton import rotary as rt
    from polyfuse.ops.rotary import rotary_native

    gen = torch.Generator().manual_seed(6)
    b, n, hq, hkv, d = 2, 5, 4, 2, 8
    x = torch.randn(b, n, 16, generator=gen)
    w = torch.randn((hq + 2 * hkv) * d, 16, generator=gen).requires_grad_()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = (
        torch.cat([ang.cos()] * 2, -1)[None].expand(b, n, d),
        torch.cat([ang.sin()] * 2, -1)[None].expand(b, n, d),
    )
    cot_q, cot_k = torch.randn(b, hq, n, d, generator=gen), torch.randn(b, hkv, n, d, generator=gen)

    def qk():
        if fused:
            qkv = torch.nn.functional.linear(x, w)
            q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], -1)
        else:
            q, k = (
                torch.nn.functional.linear(x, w[: hq * d]),
                torch.nn.functional.linear(x, w[hq * d : (hq + hkv) * d]),
            )
        return q.view(b, n, hq, d).transpose(1, 2), k.view(b, n, hkv, d).transpose(1, 2)

    q, k = qk()
    qo, ko = rt.rotary(q, k, cos, sin)
    assert qo.data_ptr() == q.data_ptr() and ko.data_ptr() == k.data_ptr(), "rotated into new buffers"
    (gw,) = torch.autograd.grad((qo * cot_q).sum() + (ko * cot_k).sum(), w)
    q, k = qk()
    rq, rk = rotary_native(q, k, cos, sin)
    torch.testing.assert_close(qo.detach(), rq.detach(), rtol=1e-5, atol=1e-5)
    (ref,) = torch.autograd.grad((rq * cot_q).sum() + (rk * cot_k).sum(), w)
    torch.testing.assert_close(gw, ref, rtol=1e-5, atol=1e-5)
    # A caller's own (leaf) tensors keep their values.
    q0 = torch.randn(b, hq, n, d, generator=gen).requires_grad_()
    k0 = torch.randn(b, hkv, n, d, generator=gen).requires_grad_()
    keep = q0.detach().clone()
    qo, _ = rt.rotary(q0, k0, cos, sin)
    assert torch.equal(q0.detach(), keep) and qo.data_ptr() != q0.data_ptr()


def test_swiglu_linear_training_keeps_no_product():
    """triton_recompute (issue 13): the down projection keeps gate/up and its weight for the backward, not the
    [..., I] product silu(gate) * up the composite keeps (recomputed instead)."""
    pytest.importorskip("triton")
    from polyfuse.backends.triton.swiglu_linear import swiglu_linear

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 5, 16, generator=gen)
    w_gu = torch.randn(48, 16, generator=gen).requires_grad_()
    w = torch.randn(16, 24, generator=gen).requires_grad_()
    shapes = {}
    for name, fn in (("fold", swiglu_linear), ("composite", lambda g, u, w: (torch.nn.functional.silu(g) * u) @ w.T)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            gu = torch.nn.functional.linear(x, w_gu)
            fn(gu[..., :24], gu[..., 24:], w).sum().backward()
        shapes[name] = saved
    assert (3, 5, 24) in shapes["composite"]
    assert (3, 5, 24) not in shapes["fold"] and (15, 24) not in shapes["fold"], shapes["fold"]
