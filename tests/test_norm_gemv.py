"""The one-row int4 pairs (backends/triton/quant/norm_gemv_q.py; gemv_q.py PAIRED): the norm's kernel, or SwiGLU's,
lets the int4 GEMV launch before it waits for the kernel before it. The arithmetic is the composite's: the same two
kernels, so the same bits (the Triton interpreter here; PDL itself only on a GPU, where the greedy tokens are
compared with PDL off)."""

import pytest
import torch
from helpers import one_thread  # noqa: F401  (autouse fixture)
from quant_cases import no_prefetch

from polyfuse.backends.triton.add_rms_norm import add_rms_norm
from polyfuse.backends.triton.quant import gemv_q, norm_gemv_q
from polyfuse.backends.triton.rms_norm import rms_norm
from polyfuse.backends.triton.swiglu import swiglu
from polyfuse.core import registry
from polyfuse.core.platform import Platform
from polyfuse.core.registry import SelectionContext
from polyfuse.ops.quant_formats import quantize


def _inputs(k=256, n=96, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, k, generator=g).to(dtype)
    res = (torch.randn(1, 1, k, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    qw = quantize("int4", torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, res, w, qw, bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_res", [True, False])
def test_norm_pair_is_the_composite_bit_for_bit(dtype, with_res):
    x, res, w, qw, bias = _inputs(dtype=dtype)
    with torch.inference_mode():
        y, r = norm_gemv_q.add_rms_norm_linear_q(x, res if with_res else None, w, 1e-5, qw, bias)
        if with_res:
            normed, r_ref = add_rms_norm(x, res, w, 1e-5)
        else:
            normed, r_ref = rms_norm(x, w, 1e-5), x
        y_ref = gemv_q.linear_q(normed, qw, bias)
    assert torch.equal(y, y_ref) and torch.equal(r, r_ref)  # torch.equal ignores dtype: checked apart
    assert (y.dtype, r.dtype) == (y_ref.dtype, r_ref.dtype) and y.shape == (1, 1, 96) and r.shape == x.shape


def test_swiglu_pair_is_the_composite_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(1, 384, generator=g).to(torch.bfloat16) for _ in range(2))
    qw = quantize("int4", torch.randn(64, 384, generator=g) * 0.05)
    with torch.inference_mode():
        got = gemv_q.swiglu_linear_q(gate, up, qw)
        want = gemv_q.linear_q(swiglu(gate, up), qw)
    assert torch.equal(got, want) and got.dtype == want.dtype


class _Spy:
    """A Triton kernel stand-in recording each launch's EARLY before launching the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.early = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.early.append(kwargs.get("EARLY"))
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_the_pairs_launch_the_small_kernels_early(monkeypatch):
    """The norm and SwiGLU kernels before the GEMV are launched with EARLY (they let it launch first), the ones the
    composite launches are not."""
    from polyfuse.backends.triton import rms_norm as rms_mod
    from polyfuse.backends.triton import swiglu as swiglu_mod

    norm_spy, swiglu_spy = _Spy(rms_mod._rms_norm_fwd_kernel), _Spy(swiglu_mod._swiglu_fwd_kernel)
    monkeypatch.setattr(rms_mod, "_rms_norm_fwd_kernel", norm_spy)
    monkeypatch.setattr(swiglu_mod, "_swiglu_fwd_kernel", swiglu_spy)
    x, res, w, qw, bias = _inputs()
    with torch.inference_mode():
        norm_gemv_q.add_rms_norm_linear_q(x, res, w, 1e-5, qw, bias)
        norm_gemv_q.add_rms_norm_linear_q(x, None, w, 1e-5, qw, bias)
        add_rms_norm(x, res, w, 1e-5)
        gemv_q.swiglu_linear_q(x, res, qw)
        swiglu(x, res)
    assert norm_spy.early == [True, True, False] and swiglu_spy.early == [True, False]


def test_no_pair_where_the_gemv_loads_nothing_early(tmp_path):
    """Act-order int4 (its groups gathered per weight) and a tile table whose int4 prefetch_regs is 0 load no weights
    before the wait: the pairs decline there (the composite's order, as for int8 / fp8)."""
    import dataclasses

    late = no_prefetch(tmp_path)
    x, res, w, qw, bias = _inputs()
    with torch.inference_mode():
        assert gemv_q.paired(qw)
        act = dataclasses.replace(qw, act_order=True)
        assert not gemv_q.paired(act)
        assert "loads no weights" in norm_gemv_q.accepts_add_rms_norm_linear_q(x, res, w, 1e-5, act)
        assert not gemv_q.paired(qw, late)
        assert "loads no weights" in norm_gemv_q.accepts_add_rms_norm_linear_q(x, res, w, 1e-5, qw, options=late)


def test_the_pair_takes_one_row_of_int4_in_inference_only():
    x, res, w, qw, bias = _inputs()
    with torch.inference_mode():
        assert norm_gemv_q.accepts_add_rms_norm_linear_q(x, res, w, 1e-5, qw) is None
        assert norm_gemv_q.accepts_add_rms_norm_linear_q(x, None, w, 1e-5, qw, bias) is None
        fp8 = quantize("fp8", torch.randn(96, 256) * 0.05)
        assert "loads no weights" in norm_gemv_q.accepts_add_rms_norm_linear_q(x, res, w, 1e-5, fp8)
        two = torch.cat([x, x], dim=1)
        assert norm_gemv_q.accepts_add_rms_norm_linear_q(two, torch.cat([res, res], 1), w, 1e-5, qw) is not None
    assert norm_gemv_q.accepts_add_rms_norm_linear_q(x, res, w.requires_grad_(), 1e-5, qw) == "needs gradients"
    assert (
        norm_gemv_q.accepts_add_rms_norm_linear_q(x, res.requires_grad_(), w.detach(), 1e-5, qw) == "needs gradients"
    )


def test_registry_puts_the_pair_first_for_one_row_and_yields_to_the_runs_norm():
    h200 = Platform("cuda", "cuda", "NVIDIA H200", (9, 0))

    def choice(overrides):
        ctx = SelectionContext(torch.device("cuda"), torch.bfloat16, platform=h200, overrides=overrides)
        return registry.select("add_rms_norm_linear_q", ctx, registry.run_overrides(ctx))

    c = choice("")
    assert (c.implementation.name, [i.name for i in c.then]) == ("gemv_q", ["fp8_scaled_mm"])
    for o in ("-add_rms_norm", "rms_norm=native", "-linear_q", "linear_q=dequant_mm"):
        assert choice(o).implementation.name != "gemv_q", o


@pytest.mark.cuda
def test_int4_batch_one_tokens_with_and_without_pdl():
    """On a Hopper GPU: a random int4 model's greedy tokens at batch 1 (the pairs run at every layer) with PDL on
    equal those with it off, graphed."""
    from helpers import tiny_config

    from polyfuse.backends.triton import _pdl
    from polyfuse.models.llama import LlamaForCausalLM

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0) or not _pdl.TRITON_HAS_PDL:
        pytest.skip("programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0 and Triton 3.4+")
    cfg = tiny_config(hidden_size=256, intermediate_size=512)
    ids = torch.randint(10, 300, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    out = {}
    for on in (False, True):
        flags = {"use_flash_attention": True, "use_cuda_graphs": True, "pdl": on}
        model = LlamaForCausalLM.from_config(cfg, dtype=torch.bfloat16, device="cuda", flags=flags, quant="int4")
        for op in ("add_rms_norm_linear_q", "swiglu_linear_q"):
            assert model.kernels.choices[op].implementation.name == "gemv_q", op
        out[on] = model.generate(ids, max_new_tokens=24, ignore_eos=True)
    assert torch.equal(out[True], out[False])
