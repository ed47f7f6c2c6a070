"""The layer's norm fused with the fp8 projection's per-token quantization (``add_rms_norm_linear_q``,
backends/triton/quant/norm_fp8_scaled_mm.py): the same bytes as the norm kernel followed by the quantizing kernel, and in a
model the same logits as the two ops; the conformance suite checks the op against its native reference."""

import pytest
import torch
import transformers
from helpers import cpu_scaled_mm_missing, tiny_config
from quant_cases import quantized

from polyfuse.core import registry
from polyfuse.models import LlamaForCausalLM


pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


SHAPES = [(67, 96), (5, 100), (9, 4096)] + ([(2048, 4096), (2048, 8192)] if DEV == "cuda" else [])


@pytest.mark.parametrize("m,h", SHAPES)
@pytest.mark.parametrize("with_res", [True, False])
def test_norm_kernel_quantizes_what_the_two_kernels_write(m, h, with_res):
    """Rows of mixed scale (a zero row, an outlier, tiny values): the e4m3 bytes and scales equal quantize_rows of the
    Triton norm's output, bit for bit under the interpreter, and the residual sum equals the norm kernel's. On the GPU
    (the 8B / 70B prefill shapes too) the two kernels add a row's squares in another order, so a rare normalized value
    may round the other way: at most 0.1% of the codes and one bf16 rounding of a scale."""
    from polyfuse.backends.triton.quant.fp8_scaled_mm import quantize_rows
    from polyfuse.backends.triton.quant.norm_fp8_scaled_mm import add_rms_norm_quantize
    from polyfuse.backends.triton.rms_norm import rms_norm_forward

    gen = torch.Generator().manual_seed(m + h)
    x = (torch.randn(m, h, generator=gen) * 3).bfloat16()
    x[min(3, m - 1)] = 0
    x[0, 7] = 1e3
    x[m // 2] = (torch.randn(h, generator=gen) * 1e-3).bfloat16()
    res = (torch.randn(m, h, generator=gen) * 5).bfloat16() if with_res else None
    w = (1 + 0.2 * torch.randn(h, generator=gen)).bfloat16()
    x, w = x.to(DEV), w.to(DEV)
    res = res.to(DEV) if res is not None else None
    q, s, r = add_rms_norm_quantize(x, res, w, 1e-5)
    y, _, r2 = rms_norm_forward(x, w, 1e-5, residual2=res)
    q2, s2 = quantize_rows(y)
    assert torch.equal(r, r2) and (with_res or r is x)
    off = (q.view(torch.uint8) != q2.view(torch.uint8)).double().mean().item()
    if DEV == "cpu":
        assert torch.equal(s, s2) and off == 0
    else:
        print(f"\n{m} x {h}: {off:.2e} of the codes differ, {(s != s2).double().mean().item():.2e} of the scales")
        torch.testing.assert_close(s, s2, rtol=2**-7, atol=0)
        assert off <= 1e-3


def test_accepts_what_the_fused_prefill_takes():
    from polyfuse.backends.triton.quant.norm_fp8_scaled_mm import accepts_add_rms_norm_linear_q as accepts

    qw = quantized("fp8", 48, 96, DEV)
    x = torch.randn(2, 40, 96, dtype=torch.bfloat16, device=DEV)
    w = torch.ones(96, dtype=torch.bfloat16, device=DEV)
    assert accepts(x, x, w, 1e-5, qw) is None and accepts(x, None, w, 1e-5, qw) is None
    assert "64 rows or fewer" in accepts(x[:, :30], None, w, 1e-5, qw)
    assert "residual" in accepts(x, x.float(), w, 1e-5, qw)
    assert "norm weight" in accepts(x, x, w.float(), 1e-5, qw)
    assert "fp8_block" in accepts(x, x, w, 1e-5, quantized("fp8_block", 48, 96, DEV))
    assert "int4" in accepts(x, x, w, 1e-5, quantized("int4", 48, 96, DEV))


def _tiny_family(family):
    """A two-layer model of ``family``: Llama, Qwen2 (q/k/v biases) or Qwen3 (per-head q/k norms, head_dim 24)."""
    from polyfuse.models import Qwen2ForCausalLM, Qwen3ForCausalLM

    if family == "llama":
        return LlamaForCausalLM.from_config(tiny_config(num_key_value_heads=2), seed=3)
    cls, cfg_cls = {"qwen2": (Qwen2ForCausalLM, transformers.Qwen2Config),
                    "qwen3": (Qwen3ForCausalLM, transformers.Qwen3Config)}[family]  # fmt: skip
    extra = {"head_dim": 24} if family == "qwen3" else {}
    cfg = cfg_cls(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, **extra)  # fmt: skip
    model = cls.from_config(cfg, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)  # Qwen2's q/k/v biases: not zero, so the fused path must add them
    return model


@pytest.mark.slow
@pytest.mark.skipif(DEV == "cpu" and cpu_scaled_mm_missing() is not None, reason="no row-wise _scaled_mm on this CPU")
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fp8_prefill_with_the_fused_norm_gives_the_two_ops_logits(tmp_path, family):
    """An fp8 model's 80-token prefill: the layer's norms and qkv / gate_up projections through the fused op (two
    calls per layer, each taken) give the logits of the Triton norm followed by the fp8 linear_q (exactly under the
    interpreter; on the GPU within the norms' summation order), for Llama, Qwen2 (biases) and Qwen3 (q/k norms)."""
    _tiny_family(family).save_pretrained(str(tmp_path))
    model = type(_tiny_family(family)).from_pretrained(str(tmp_path), quant="fp8", dtype=torch.bfloat16, device=DEV)
    k = model.kernels
    k.rms_norm, k.add_rms_norm = registry.bound("rms_norm", "triton"), registry.bound("add_rms_norm", "triton")
    k.linear_q = registry.bound("linear_q", "fp8_scaled_mm")
    ids = torch.randint(10, 300, (2, 40), generator=torch.Generator().manual_seed(5)).to(DEV)
    composite = registry.ops()["add_rms_norm_linear_q"].compose(k)
    k.add_rms_norm_linear_q = composite
    with torch.inference_mode():
        want = model(ids).logits
    fused, calls = registry.bound("add_rms_norm_linear_q", "fp8_scaled_mm"), []
    from polyfuse.backends.triton.quant.norm_fp8_scaled_mm import accepts_add_rms_norm_linear_q

    def spy(*a):
        calls.append(accepts_add_rms_norm_linear_q(*a))
        return fused(*a)

    k.add_rms_norm_linear_q = spy
    with torch.inference_mode():
        got = model(ids).logits
    assert calls == [None] * (2 * model.config.num_hidden_layers)
    if DEV == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.float().pow(2).mean().sqrt().item())


def test_the_fused_prefill_yields_to_the_runs_own_norm_or_linear_q():
    """-rms_norm, -add_rms_norm, -linear_q or another linear_q implementation named by the run: the composite runs
    (which honours them), not the kernel that folds both; +op and the kernels it folds keep it."""
    from polyfuse.backends.triton.register import probe_norm_scaled_mm
    from polyfuse.core.platform import Platform
    from polyfuse.core.registry import SelectionContext

    h200 = Platform("cuda", "cuda", "NVIDIA H200", (9, 0))

    def why(overrides):
        return probe_norm_scaled_mm(SelectionContext(torch.device("cuda"), torch.bfloat16, platform=h200,
                                                     overrides=overrides))  # fmt: skip

    for o in ("-rms_norm", "-add_rms_norm", "-linear_q", "linear_q=native", "add_rms_norm=native"):
        assert "the composite runs" in why(o), o
    for o in ("", "+rms_norm", "linear_q=fp8_scaled_mm", "add_rms_norm=triton", "-swiglu"):
        assert why(o) is None, (o, why(o))
