"""The layer's norm fused with the fp8 projection's per-token quantization (``add_rms_norm_linear_q``,
backends/triton/norm_quantize.py): the same bytes as the norm kernel followed by the quantizing kernel, and in a
model the same logits as the two ops; the conformance suite checks the op against its native reference."""

import pytest
import torch
from helpers import cpu_scaled_mm_missing, tiny_config
from quant_cases import quantized

from polyfuse.core import registry
from polyfuse.models import LlamaForCausalLM


pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,h", [(67, 96), (5, 100), (9, 4096)])
@pytest.mark.parametrize("with_res", [True, False])
def test_norm_kernel_quantizes_what_the_two_kernels_write(m, h, with_res):
    """Rows of mixed scale (a zero row, an outlier, tiny values): the e4m3 bytes and scales equal quantize_rows of the
    Triton norm's output, bit for bit, and the residual sum equals the norm kernel's."""
    from polyfuse.backends.triton.norm_quantize import add_rms_norm_quantize
    from polyfuse.backends.triton.rms_norm import rms_norm_forward
    from polyfuse.backends.triton.scaled_mm import quantize_rows

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
    assert torch.equal(s, s2)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


def test_accepts_what_the_fused_prefill_takes():
    from polyfuse.backends.triton.norm_quantize import accepts_add_rms_norm_linear_q as accepts

    qw = quantized("fp8", 48, 96, DEV)
    x = torch.randn(2, 40, 96, dtype=torch.bfloat16, device=DEV)
    w = torch.ones(96, dtype=torch.bfloat16, device=DEV)
    assert accepts(x, x, w, 1e-5, qw) is None and accepts(x, None, w, 1e-5, qw) is None
    assert "64 rows or fewer" in accepts(x[:, :30], None, w, 1e-5, qw)
    assert "residual" in accepts(x, x.float(), w, 1e-5, qw)
    assert "norm weight" in accepts(x, x, w.float(), 1e-5, qw)
    assert "fp8_block" in accepts(x, x, w, 1e-5, quantized("fp8_block", 48, 96, DEV))
    assert "int4" in accepts(x, x, w, 1e-5, quantized("int4", 48, 96, DEV))


@pytest.mark.skipif(DEV == "cpu" and cpu_scaled_mm_missing() is not None, reason="no row-wise _scaled_mm on this CPU")
def test_fp8_prefill_with_the_fused_norm_gives_the_two_ops_logits(tmp_path):
    """An fp8 model's 80-token prefill: the layer's norms and qkv / gate_up projections through the fused op (two
    calls per layer, each taken) give exactly the logits of the Triton norm followed by the fp8 linear_q."""
    src = LlamaForCausalLM.from_config(tiny_config(num_key_value_heads=2), seed=3)
    src.save_pretrained(str(tmp_path))
    model = LlamaForCausalLM.from_pretrained(str(tmp_path), quant="fp8", dtype=torch.bfloat16, device=DEV)
    k = model.kernels
    k.rms_norm, k.add_rms_norm = registry.bound("rms_norm", "triton"), registry.bound("add_rms_norm", "triton")
    k.linear_q = registry.bound("linear_q", "fp8_scaled_mm")
    ids = torch.randint(10, 300, (2, 40), generator=torch.Generator().manual_seed(5)).to(DEV)
    composite = registry.ops()["add_rms_norm_linear_q"].compose(k)
    k.add_rms_norm_linear_q = composite
    with torch.inference_mode():
        want = model(ids).logits
    fused, calls = registry.bound("add_rms_norm_linear_q", "fp8_scaled_mm"), []
    from polyfuse.backends.triton.norm_quantize import accepts_add_rms_norm_linear_q

    def spy(*a):
        calls.append(accepts_add_rms_norm_linear_q(*a))
        return fused(*a)

    k.add_rms_norm_linear_q = spy
    with torch.inference_mode():
        got = model(ids).logits
    assert calls == [None] * (2 * model.config.num_hidden_layers)
    assert torch.equal(got, want)
