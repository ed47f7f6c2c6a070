"""HPU (Intel Gaudi) backend.

Everything not marked ``hpu`` runs in CI without Gaudi: the implementations are called directly on CPU tensors
against the TEST DOUBLE of ``habana_frameworks`` in tests/habana_double (put on sys.path by the ``hf`` fixture only),
and the registry and runtime are exercised with ``torch.device("hpu")``, which constructs without the hardware.
Tests marked ``hpu`` run the real kernels on a Gaudi (``make test-hpu``).
"""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyfuse.backends.hpu import _habana
from polyfuse.backends.hpu.attention import fused_sdpa
from polyfuse.backends.hpu.optim import fused_adamw, fused_clip_norm
from polyfuse.backends.hpu.rms_norm import fused_add_rms_norm, fused_rms_norm
from polyfuse.backends.hpu.rotary import fused_rope
from polyfuse.backends.hpu.runtime import HpuGraphStep, HpuRuntime
from polyfuse.core import registry
from polyfuse.core.registry import SelectionContext
from polyfuse.core.runtime import DeviceRuntime, get_runtime
from polyfuse.ops.add_rms_norm import add_rms_norm_native
from polyfuse.ops.attention import AttentionMeta, attention_native
from polyfuse.ops.rms_norm import rms_norm_native
from polyfuse.ops.rotary import rotary_native


DOUBLE = Path(__file__).parent / "habana_double"
HPU = torch.device("hpu")
REAL_HABANA = importlib.util.find_spec("habana_frameworks") is not None
needs_gaudi = pytest.mark.skipif(not REAL_HABANA, reason="needs an Intel Gaudi with habana_frameworks")


def no_default_device():
    """``set_default_device(None)``; torch 2.7 leaves a None context behind that its get_default_device trips on."""
    torch.set_default_device(None)
    if getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", False) is None:
        del torch._GLOBAL_DEVICE_CONTEXT.device_context


def _forget_habana():
    double = sys.modules.get("habana_frameworks")
    if double is not None and getattr(double, "TEST_DOUBLE", False):
        double.shutdown()  # the double's hpu device goes with it
    for name in list(sys.modules):
        if name == "habana_frameworks" or name.startswith("habana_frameworks."):
            del sys.modules[name]
    _habana.clear_cache()
    # transformers caches "is there an HPU?" (set_seed then calls torch.hpu): ask again once the double is gone
    from transformers.utils import import_utils

    for name in ("is_torch_hpu_available",):
        cached = getattr(import_utils, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    # accelerate caches it too (arguments made with the double set up an hpu PartialState)
    from accelerate.utils import imports as accelerate_imports

    accelerate_imports.is_hpu_available.cache_clear()


def _import_double(monkeypatch, lazy):
    """Put the test double on sys.path and import it with PT_HPU_LAZY_MODE set first (like the real bridge, it fixes
    the mode at import); ``lazy=None`` leaves the variable unset (eager on Synapse 1.21+)."""
    _forget_habana()
    if lazy is None:
        monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    else:
        monkeypatch.setenv("PT_HPU_LAZY_MODE", "1" if lazy else "0")
    monkeypatch.syspath_prepend(str(DOUBLE))
    import habana_frameworks

    assert habana_frameworks.TEST_DOUBLE
    habana_frameworks.reset()
    return habana_frameworks


@pytest.fixture
def hf(monkeypatch, request):
    """The test double of habana_frameworks, importable for this test only, in the mode the test asks for with the
    ``lazy`` / ``eager`` fixtures (neither: PT_HPU_LAZY_MODE unset)."""
    names = request.fixturenames
    double = _import_double(monkeypatch, True if "lazy" in names else False if "eager" in names else None)
    import habana_frameworks.torch  # noqa: F401  (the double's hpu device, as the bridge registers it)

    torch.set_default_device("hpu")  # tensors the test makes are HPU tensors, as on a Gaudi
    yield double
    no_default_device()
    _forget_habana()


@pytest.fixture
def hf_bare(monkeypatch):
    """The double importable, its bridge (habana_frameworks.torch) not imported yet."""
    yield _import_double(monkeypatch, None)
    _forget_habana()


@pytest.fixture
def no_habana(monkeypatch):
    """habana_frameworks not importable, even on a machine that has it."""
    _forget_habana()
    monkeypatch.setitem(sys.modules, "habana_frameworks", None)
    yield
    _habana.clear_cache()


@pytest.fixture
def lazy(monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")


@pytest.fixture
def eager(monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")


class Habana:
    """One way of running the HPU backend: the test double in lazy or eager mode on CPU tensors, or a real Gaudi in
    the mode its process was started in (``make test-hpu``)."""

    def __init__(self, name, double, device, lazy):
        self.name, self.double, self.device, self.lazy = name, double, device, lazy

    def calls(self, name):
        return self.double.calls(name) if self.double is not None else None


BACKENDS = [
    pytest.param("double-lazy", id="double-lazy"),
    pytest.param("double-eager", id="double-eager"),
    pytest.param("gaudi", id="gaudi", marks=[pytest.mark.hpu, needs_gaudi]),
]


@pytest.fixture
def habana(request, monkeypatch):
    """Parametrized with BACKENDS (``indirect=True``)."""
    name = getattr(request, "param", "double-lazy")
    if name == "gaudi":
        _habana.clear_cache()
        import habana_frameworks.torch  # noqa: F401  (registers the hpu device with torch)
        from habana_frameworks.torch.utils.internal import is_lazy

        assert not getattr(sys.modules["habana_frameworks"], "TEST_DOUBLE", False)
        yield Habana(name, None, torch.device("hpu"), is_lazy())
        return
    lazy_mode = name == "double-lazy"
    double = _import_double(monkeypatch, lazy_mode)
    import habana_frameworks.torch  # noqa: F401  (the double's hpu device)

    yield Habana(name, double, torch.device("hpu"), lazy_mode)
    _forget_habana()


def _qkv(b=2, hq=4, hkv=2, lq=6, lk=6, d=16, dtype=torch.float32, seed=0):
    """Drawn on the host from a seeded generator, then on the default device (the double's HPU under ``hf``)."""
    g = torch.Generator().manual_seed(seed)
    dev = torch.get_default_device()
    q = torch.randn(b, hq, lq, d, generator=g, device="cpu").to(dtype).to(dev)
    k = torch.randn(b, hkv, lk, d, generator=g, device="cpu").to(dtype).to(dev)
    v = torch.randn(b, hkv, lk, d, generator=g, device="cpu").to(dtype).to(dev)
    return q, k, v


def _padded_causal_mask(lengths, l, dtype):
    """Additive [B, 1, L, L] causal + left-padding mask, as the model builds it for a left-padded prefill."""
    neg = torch.finfo(dtype).min
    pos = torch.arange(l)
    causal = pos[None, :] > pos[:, None]
    pad = pos[None, :] < (l - lengths[:, None])
    drop = causal[None] | pad[:, None, :]
    return torch.zeros(drop.shape, dtype=dtype).masked_fill(drop, neg)[:, None]


def _valid_rows(out, lengths):
    l = out.shape[2]
    return [out[b, :, l - int(n) :] for b, n in enumerate(lengths)]


def _assert_valid_rows_close(a, b, lengths, **tol):
    for x, y in zip(_valid_rows(a, lengths), _valid_rows(b, lengths)):
        torch.testing.assert_close(x.float(), y.float(), **tol)


TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


# -- import hygiene ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_polyfuse_import_never_imports_habana():
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import polyfuse, polyfuse.backends.hpu\n"
        "from polyfuse.core import registry; registry.ops()\n"
        "assert not [m for m in sys.modules if m.startswith('habana_frameworks')], 'habana imported'\n"
    ) % str(DOUBLE)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_hpu_device_constructs_without_hardware():
    assert torch.device("hpu").type == "hpu"


# -- attention: arguments per flag combination -------------------------------------------------------------------------


def _last_sdpa(hf):
    calls = hf.calls("FusedSDPA")
    assert len(calls) == 1
    args, kwargs = calls[0]
    assert kwargs == {}
    assert len(args) == 11
    return args


def test_sdpa_decode_args(hf):
    q, k, v = _qkv(lq=1, lk=9)
    mask = torch.zeros(2, 1, 1, 9)
    mask[0, ..., :3] = torch.finfo(torch.float32).min
    meta = AttentionMeta(
        scale=16**-0.5, mask=mask, decode=True, causal_prefill=True, recompute=True, fast_softmax=True
    )
    fused_sdpa(q, k, v, meta)
    args = _last_sdpa(hf)
    assert args[0] is q
    assert args[1] is k and args[2] is v  # GQA: k/v [2, 2, 9, 16] unrepeated next to q [2, 4, 1, 16]
    assert args[3] is mask
    # decode ignores the prefill options: (mask, 0.0, False, None, "None", False, None, "None")
    assert args[4:] == (0.0, False, None, "None", False, None, "None")


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("fast", [False, True])
def test_sdpa_prefill_causal_args(hf, recompute, fast):
    q, k, v = _qkv()
    lengths = torch.tensor([6, 4], dtype=torch.int32)
    meta = AttentionMeta(
        scale=16**-0.5,
        mask=_padded_causal_mask(lengths, 6, torch.float32),
        valid_lengths=lengths,
        causal_prefill=True,
        recompute=recompute,
        fast_softmax=fast,
    )
    fused_sdpa(q, k, v, meta)
    args = _last_sdpa(hf)
    assert args[3] is None
    assert args[4:9] == (0.0, True, None, "fast" if fast else "None", recompute)
    assert args[9] is lengths
    assert args[10] == "left"


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("fast", [False, True])
def test_sdpa_prefill_mask_args(hf, recompute, fast):
    q, k, v = _qkv()
    lengths = torch.tensor([6, 4])
    mask = _padded_causal_mask(lengths, 6, torch.float32)
    meta = AttentionMeta(scale=16**-0.5, mask=mask, recompute=recompute, fast_softmax=fast)
    fused_sdpa(q, k, v, meta)
    args = _last_sdpa(hf)
    assert args[3] is mask
    assert args[4:] == (0.0, False, None, "fast" if fast else "None", recompute, None, "None")


def test_sdpa_prefill_no_mask_is_causal_uses_kernel_causal_mode(hf):
    q, k, v = _qkv()
    fused_sdpa(q, k, v, AttentionMeta(scale=16**-0.5, is_causal=True))
    assert _last_sdpa(hf)[3:] == (None, 0.0, True, None, "None", False, None, "None")


def test_sdpa_causal_with_longer_keys_passes_explicit_mask(hf):
    q, k, v = _qkv(lq=3, lk=8)
    out = fused_sdpa(q, k, v, AttentionMeta(scale=16**-0.5, is_causal=True, causal_prefill=True))
    args = _last_sdpa(hf)
    assert args[5] is False and args[3].shape == (1, 1, 3, 8)
    torch.testing.assert_close(out, attention_native(q, k, v, AttentionMeta(scale=16**-0.5, is_causal=True)))


def test_sdpa_casts_lengths_to_int32_mask_to_q_dtype_and_passes_custom_scale(hf):
    q, k, v = _qkv(dtype=torch.bfloat16)
    meta = AttentionMeta(scale=0.1, valid_lengths=torch.tensor([6, 4]), causal_prefill=True)
    fused_sdpa(q, k, v, meta)
    args = _last_sdpa(hf)
    assert args[6] == 0.1 and args[9].dtype == torch.int32
    hf.reset()
    fused_sdpa(q, k, v, AttentionMeta(scale=0.1, mask=torch.zeros(2, 1, 6, 6)))
    assert _last_sdpa(hf)[3].dtype == torch.bfloat16


def test_double_rejects_bad_arguments(hf):
    from habana_frameworks.torch.hpex.kernels import FusedSDPA

    q, k, v = _qkv(hkv=4)
    ok = (q, k, v, None, 0.0, True, None, "None", False, torch.tensor([6, 6], dtype=torch.int32), "left")
    FusedSDPA.apply(*ok)
    bad = {
        7: "slow",  # softmax_mode
        10: "middle",  # padding_side
        9: torch.tensor([6, 6]),  # int64 lengths
    }
    for index, value in bad.items():
        args = list(ok)
        args[index] = value
        with pytest.raises(ValueError):
            FusedSDPA.apply(*args)
    with pytest.raises(ValueError):  # lengths without causal mode
        FusedSDPA.apply(q, k, v, None, 0.0, False, None, "None", False, ok[9], "left")
    with pytest.raises(ValueError):  # keyword call
        FusedSDPA.apply(q, k, v, None, 0.0, True, None, "None", False, None, padding_side="None")
    # Grouped-query attention: fewer k/v heads than q heads is the kernel's own business; a non-divisor is not.
    FusedSDPA.apply(q, k[:, :2], v[:, :2], None, 0.0, False, None, "None", False, None, "None")
    FusedSDPA.apply(q, k[:, :1], v[:, :1], None, 0.0, False, None, "None", False, None, "None")
    with pytest.raises(ValueError, match="multiple"):
        FusedSDPA.apply(q, k[:, :3], v[:, :3], None, 0.0, False, None, "None", False, None, "None")
    with pytest.raises(ValueError, match="attn_mask"):  # a mask's head dim must be 1 or Hq (reshaped per group)
        FusedSDPA.apply(q, k[:, :2], v[:, :2], torch.zeros(2, 2, 6, 6), 0.0, False, None, "None", False, None, "None")


def test_double_enforces_the_kernels_training_asserts(hf):
    """The real kernel asserts valid_sequence_lengths only in inference, and fast softmax in recompute training only
    with its causal flag (Habana's hpex/kernels/FusedSDPA.py, sdpa_fwd_wrapper)."""
    from habana_frameworks.torch.hpex.kernels import FusedSDPA

    q, k, v = _qkv(hkv=2)
    lengths = torch.tensor([6, 4], dtype=torch.int32)
    FusedSDPA.apply(q, k, v, None, 0.0, True, None, "None", False, lengths, "left")  # inference: fine
    q.requires_grad_()
    with pytest.raises(ValueError, match="only in inference"):
        FusedSDPA.apply(q, k, v, None, 0.0, True, None, "None", False, lengths, "left")
    mask = torch.zeros(2, 1, 6, 6)
    with pytest.raises(ValueError, match="fast"):
        FusedSDPA.apply(q, k, v, mask, 0.0, False, None, "fast", True, None, "None")
    FusedSDPA.apply(q, k, v, None, 0.0, True, None, "fast", True, None, "None")  # causal: allowed


# -- attention: numerical parity with the native reference -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_parity_decode(hf, dtype):
    q, k, v = _qkv(lq=1, lk=9, dtype=dtype)
    mask = torch.zeros(2, 1, 1, 9, dtype=dtype)
    mask[1, ..., :4] = torch.finfo(dtype).min
    meta = AttentionMeta(scale=16**-0.5, mask=mask, decode=True)
    torch.testing.assert_close(fused_sdpa(q, k, v, meta), attention_native(q, k, v, meta), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal_prefill", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_sdpa_parity_prefill(hf, dtype, causal_prefill, recompute):
    q, k, v = _qkv(dtype=dtype)
    lengths = torch.tensor([6, 3], dtype=torch.int32)
    meta = AttentionMeta(
        scale=16**-0.5,
        mask=_padded_causal_mask(lengths, 6, dtype),
        valid_lengths=lengths,
        causal_prefill=causal_prefill,
        recompute=recompute,
    )
    _assert_valid_rows_close(fused_sdpa(q, k, v, meta), attention_native(q, k, v, meta), lengths, **TOL[dtype])


def test_sdpa_parity_fast_softmax_bf16(hf):
    q, k, v = _qkv(dtype=torch.bfloat16)
    lengths = torch.tensor([6, 5], dtype=torch.int32)
    meta = AttentionMeta(
        scale=16**-0.5, mask=_padded_causal_mask(lengths, 6, torch.bfloat16), valid_lengths=lengths, fast_softmax=True
    )
    out = fused_sdpa(q, k, v, meta)
    _assert_valid_rows_close(out, attention_native(q, k, v, meta), lengths, atol=5e-2, rtol=5e-2)


def test_sdpa_backward_through_double(hf):
    q, k, v = (t.requires_grad_() for t in _qkv(hkv=4))
    fused_sdpa(q, k, v, AttentionMeta(scale=0.25, is_causal=True)).sum().backward()
    assert q.grad is not None and k.grad is not None


def _right_padded_causal_mask(lengths, l, dtype):
    """Additive [B, 1, L, L] causal + right-padding mask, as a training collator's batch gives it."""
    neg = torch.finfo(dtype).min
    pos = torch.arange(l)
    drop = (pos[None, :] > pos[:, None])[None] | (pos[None, :] >= lengths[:, None])[:, None, :]
    return torch.zeros(drop.shape, dtype=dtype).masked_fill(drop, neg)[:, None]


GQA_BACKENDS = [BACKENDS[0], BACKENDS[2]]  # the double, and a real Gaudi under make test-hpu


@pytest.mark.parametrize("habana", GQA_BACKENDS, indirect=True)
@pytest.mark.parametrize("hkv", [1, 2, 8])
@pytest.mark.parametrize("call", ["decode", "prefill-lengths", "prefill-mask", "prefill-causal"])
def test_gqa_kv_go_unrepeated_and_match_native(habana, hkv, call):
    """Grouped-query attention: k/v reach FusedSDPA with their own head count, as optimum-habana passes them, on every
    call path; the kernel's result equals the native reference (which repeats k/v)."""
    dev, decode = habana.device, call == "decode"
    lq = 1 if decode else 16
    q, k, v = (t.to(dev) for t in _qkv(b=2, hq=8, hkv=hkv, lq=lq, lk=16, d=64, dtype=torch.bfloat16))
    lengths = torch.tensor([16, 11], dtype=torch.int32)
    mask = _padded_causal_mask(lengths, 16, torch.bfloat16)
    if call == "prefill-causal":
        meta, lengths = AttentionMeta(scale=64**-0.5, is_causal=True), torch.tensor([16, 16])
    else:
        meta = AttentionMeta(
            scale=64**-0.5, mask=(mask[:, :, -1:] if decode else mask).to(dev), valid_lengths=lengths.to(dev),
            decode=decode, causal_prefill=call == "prefill-lengths",
        )  # fmt: skip
    out = fused_sdpa(q, k, v, meta)
    if habana.double is not None:
        args = _last_sdpa(habana.double)
        assert args[0] is q and args[1] is k and args[2] is v
        assert tuple(args[1].shape) == (2, hkv, 16, 64) and tuple(args[0].shape) == (2, 8, lq, 64)
        assert (args[9] is not None) == (call == "prefill-lengths")
    ref = attention_native(q, k, v, meta)
    _assert_valid_rows_close(out.cpu(), ref.cpu(), torch.ones(2) if decode else lengths, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("fast", [False, True])
def test_sdpa_training_takes_the_mask_not_lengths(hf, fast):
    """With gradients on, FusedSDPA never gets valid_sequence_lengths (the real kernel asserts inference) nor fast
    softmax in non-causal recompute mode: the mask goes instead, right for the right padding of training batches."""
    q, k, v = (t.requires_grad_() for t in _qkv(hkv=2))
    lengths = torch.tensor([6, 4], dtype=torch.int32)
    mask = _right_padded_causal_mask(lengths, 6, torch.float32)
    meta = AttentionMeta(
        scale=16**-0.5, mask=mask, valid_lengths=lengths, causal_prefill=True, recompute=True, fast_softmax=fast
    )
    out = fused_sdpa(q, k, v, meta)
    args = _last_sdpa(hf)
    assert args[3] is mask and args[5] is False and args[9] is None and args[10] == "None"
    assert args[7] == "None" and args[8] is True
    grads = torch.autograd.grad(out[0, :, :6].sum() + out[1, :, :4].sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = attention_native(q2, k2, v2, meta)
    want = torch.autograd.grad(ref[0, :, :6].sum() + ref[1, :, :4].sum(), (q2, k2, v2))
    torch.testing.assert_close(out[0], ref[0], **TOL[torch.float32])
    torch.testing.assert_close(out[1, :, :4], ref[1, :, :4], **TOL[torch.float32])
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_sdpa_mask_without_lengths_is_never_dropped(hf):
    """The transformers-patch path gives a padding mask and no lengths: with --flash_attention_causal_mask the mask
    must still reach the kernel (it used to take the causal mode with no lengths and attend to the padding)."""
    q, k, v = _qkv(hkv=2)
    lengths = torch.tensor([6, 3], dtype=torch.int32)
    mask = _padded_causal_mask(lengths, 6, torch.float32)
    meta = AttentionMeta(scale=16**-0.5, mask=mask, causal_prefill=True)
    out = fused_sdpa(q, k, v, meta)
    args = _last_sdpa(hf)
    assert args[3] is mask and args[5] is False and args[9] is None
    _assert_valid_rows_close(out, attention_native(q, k, v, meta), lengths, **TOL[torch.float32])


def test_eager_attention_softmax_bf16():
    """--attn_softmax_bf16 (Gaudi eager attention) is honoured by the native attention the registry gives HPU runs
    without --use_flash_attention."""
    q, k, v = _qkv(dtype=torch.bfloat16)
    lengths = torch.tensor([6, 4])
    mask = _padded_causal_mask(lengths, 6, torch.bfloat16)
    meta = AttentionMeta(scale=16**-0.5, mask=mask)
    meta_bf16 = AttentionMeta(scale=16**-0.5, mask=mask, softmax_bf16=True)
    out = attention_native(q, k, v, meta_bf16)
    # Softmax in bf16 (not fp32): same as doing it by hand in the query dtype.
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.matmul(q, kr.transpose(2, 3)) * meta.scale + mask
    expected = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.bfloat16), vr)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    _assert_valid_rows_close(out, attention_native(q, k, v, meta), lengths, atol=3e-2, rtol=3e-2)


# -- rms_norm / add_rms_norm -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_rms_norm_args_and_parity(hf, x_dtype, w_dtype):
    x = torch.randn(2, 5, 32).to(x_dtype)
    w = (1 + 0.1 * torch.randn(32)).to(w_dtype)
    y = fused_rms_norm(x, w, 1e-6)
    ((args, kwargs),) = hf.calls("FusedRMSNorm")
    assert args[0] is x and args[1] is w and args[2] == 1e-6 and kwargs == {}
    assert y.dtype == x_dtype
    torch.testing.assert_close(y, rms_norm_native(x, w, 1e-6), **TOL[x_dtype])


def test_rms_norm_casts_x_to_weight_dtype_and_back(hf):
    x = torch.randn(2, 5, 32, dtype=torch.float32)
    w = torch.ones(32, dtype=torch.bfloat16)
    y = fused_rms_norm(x, w, 1e-5)
    ((args, _),) = hf.calls("FusedRMSNorm")
    assert args[0].dtype == torch.bfloat16 and y.dtype == torch.float32
    torch.testing.assert_close(y, rms_norm_native(x, w, 1e-5).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_parity(hf, dtype):
    x, res = torch.randn(2, 5, 32).to(dtype), torch.randn(2, 5, 32).to(dtype)
    w = (1 + 0.1 * torch.randn(32)).to(dtype)
    y, r = fused_add_rms_norm(x, res, w, 1e-6)
    y_ref, r_ref = add_rms_norm_native(x, res, w, 1e-6)
    torch.testing.assert_close(r, r_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    assert len(hf.calls("FusedRMSNorm")) == 1


# -- rotary -----------------------------------------------------------------------------------------------------------


def _cos_sin(b, l, d, offset=0):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    pos = torch.arange(offset, offset + l).float()[None, :].expand(b, l) + torch.arange(b)[:, None] * 3
    freqs = pos[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("l", [7, 1])
def test_rope_args_and_parity(hf, dtype, l):
    q, k, _ = _qkv(lq=l, lk=l, dtype=dtype)
    cos, sin = _cos_sin(2, l, 16)
    q_out, k_out = fused_rope(q, k, cos, sin)
    calls = hf.calls("RotaryPosEmbeddingHelperV2")
    assert len(calls) == 2 and calls[0][0][0] is q and calls[1][0][0] is k
    for args, kwargs in calls:
        _, c, s, pos = args
        assert kwargs == {}
        assert c.shape == (1, 1, 2 * l, 16) and s.shape == c.shape
        assert c.dtype == dtype and s.dtype == dtype  # cast to q's dtype, else Habana would compute in fp32
        assert pos.dtype == torch.int64 and torch.equal(pos, torch.arange(2 * l).view(2, l))
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    q_ref, k_ref = rotary_native(q, k, cos, sin)
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])


def test_rope_tables_shared_by_the_batch(hf):
    """cos/sin [1, L, D] for a batch of 2 (transformers' layout for position_ids [1, L], the patch path): the kernel
    gets position_ids [B, L], one row per row of x."""
    q, k, _ = _qkv(lq=5, lk=5)
    cos, sin = _cos_sin(1, 5, 16)
    q_out, k_out = fused_rope(q, k, cos, sin)
    (args, _), _ = hf.calls("RotaryPosEmbeddingHelperV2")
    assert args[1].shape == (1, 1, 5, 16) and args[3].shape == (2, 5)
    for a, b in zip((q_out, k_out), rotary_native(q, k, cos, sin)):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_rope_double_promotes_fp32_tables(hf):
    from habana_frameworks.torch.hpex.kernels import RotaryPosEmbeddingHelperV2

    q = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16)
    cos, sin = _cos_sin(1, 3, 8)
    out = RotaryPosEmbeddingHelperV2.apply(q, cos[:, None], sin[:, None], None)
    assert out.dtype == torch.float32  # why fused_rope casts the tables first


# -- registry ---------------------------------------------------------------------------------------------------------

FUSED = {"attention": "fused_sdpa", "rms_norm": "fused_rms_norm", "add_rms_norm": "fused_add_rms_norm"}
FUSED["rotary"] = "fused_rope"


def test_registry_implementations_declared():
    for op, name in FUSED.items():
        impl = next(i for i in registry.implementations(op) if i.name == name)
        assert impl.backend == "hpu" and impl.devices == ("hpu",) and impl.supports_backward


@pytest.mark.parametrize("training", [False, True])
def test_registry_selects_fused_on_hpu_with_habana(hf, training):
    ctx = SelectionContext(HPU, torch.bfloat16, flags={"use_flash_attention": True}, training=training)
    kernels = registry.resolve(ctx)
    for op, name in FUSED.items():
        assert kernels.choices[op].implementation.name == name, kernels.report()
    assert kernels.attention is fused_sdpa and kernels.rms_norm is fused_rms_norm


def test_registry_attention_needs_flash_flag(hf):
    kernels = registry.resolve(SelectionContext(HPU, torch.bfloat16))
    assert kernels.choices["attention"].implementation.name == "native"
    assert "--use_flash_attention not set" in kernels.choices["attention"].reason
    assert kernels.choices["rms_norm"].implementation.name == "fused_rms_norm"
    kernels = registry.resolve(SelectionContext(HPU, torch.bfloat16, overrides="+attention,-rotary"))
    assert kernels.choices["attention"].implementation.name == "fused_sdpa"
    assert kernels.choices["rotary"].implementation.name == "native"


def test_registry_falls_back_without_habana(no_habana):
    kernels = registry.resolve(SelectionContext(HPU, torch.bfloat16, flags={"use_flash_attention": True}))
    expect = {
        "attention": "fused_sdpa: habana_frameworks.torch.hpex.kernels.FusedSDPA not importable",
        "rms_norm": "fused_rms_norm: habana_frameworks.torch.hpex.normalization.FusedRMSNorm not importable",
        "add_rms_norm": "fused_add_rms_norm: habana_frameworks.torch.hpex.normalization.FusedRMSNorm not importable",
        "rotary": "fused_rope: habana_frameworks.torch.hpex.kernels.RotaryPosEmbeddingHelperV2 not importable",
    }
    for op, reason in expect.items():
        choice = kernels.choices[op]
        assert choice.implementation.name == "native"
        assert choice.reason == "fallback: " + reason


def test_registry_never_picks_hpu_impls_on_cpu(hf):
    kernels = registry.resolve(SelectionContext(torch.device("cpu"), flags={"use_flash_attention": True}))
    for op in FUSED:
        assert kernels.choices[op].implementation.backend != "hpu"


# -- runtime: graphs -------------------------------------------------------------------------------------------------


class _Step(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def _names(hf):
    return [n for n, _, _ in hf.CALLS]


def test_get_runtime_hpu(hf):
    rt = get_runtime("hpu")
    assert isinstance(rt, HpuRuntime) and "use_hpu_graphs" in rt.honours and rt.device.type == "hpu"


def test_graph_module_without_flag_is_identity(hf, lazy):
    m = _Step()
    for phase in ("prefill", "decode"):
        assert get_runtime("hpu").graph_module(m, phase, {}).fn is m
    assert "wrap_in_hpu_graph" not in _names(hf)


def test_graph_module_wraps_both_phases_once(hf, lazy):
    rt, m = get_runtime("hpu"), _Step()
    flags = {"use_hpu_graphs": True}
    prefill = rt.graph_module(m, "prefill", flags)
    decode = rt.graph_module(m, "decode", flags)
    assert isinstance(prefill, HpuGraphStep) and isinstance(decode, HpuGraphStep)
    assert prefill.module is m and decode.module is m and not prefill.bypass and not decode.bypass
    assert len(hf.calls("wrap_in_hpu_graph")) == 1
    x = torch.randn(2, 4)
    prefill(x)
    decode(x)
    decode(torch.randn(2, 4))
    assert [n for n in _names(hf) if n.startswith("hpu_graph")] == ["hpu_graph_capture"] + ["hpu_graph_replay"] * 2
    # After the KV cache is reallocated the generation loop calls reset(): graphs are captured again.
    hf.reset()
    decode.reset()
    decode(x)
    decode(x)
    assert [n for n in _names(hf) if n.startswith("hpu_graph")] == ["hpu_graph_capture", "hpu_graph_replay"]


def test_limit_hpu_graphs_bypasses_prefill_only(hf, lazy):
    rt, m = get_runtime("hpu"), _Step()
    flags = {"use_hpu_graphs": True, "limit_hpu_graphs": True, "max_graphs": 8}
    prefill = rt.graph_module(m, "prefill", flags)
    decode = rt.graph_module(m, "decode", flags)
    assert prefill.bypass and not decode.bypass and prefill.module is decode.module is m
    assert hf.calls("wrap_in_hpu_graph")[0][1] == {"max_graphs": 8}
    x = torch.randn(2, 4)
    torch.testing.assert_close(prefill(x), m.lin(x))
    decode(x)
    assert [n for n in _names(hf) if n.startswith("hpu_graph")] == ["hpu_graph_bypass", "hpu_graph_capture"]


def test_hpu_graphs_need_lazy_mode(hf, eager):
    rt, m = get_runtime("hpu"), _Step()
    with pytest.raises(ValueError) as err:
        rt.graph_module(m, "decode", {"use_hpu_graphs": True})
    msg = str(err.value)
    assert "PT_HPU_LAZY_MODE=1" in msg and "container" not in msg and "\n" not in msg
    # torch.compile owns graphs there: optimum-habana turns --use_hpu_graphs off.
    assert rt.graph_module(m, "decode", {"use_hpu_graphs": True, "torch_compile": True}).fn is m
    assert "wrap_in_hpu_graph" not in _names(hf)
    with pytest.raises(ValueError, match="phase"):
        rt.graph_module(m, "train", {})


def test_double_exports_graphs_in_lazy_mode_only(monkeypatch):
    """As the real bridge (``if is_lazy(): from .graphs import *`` in habana_frameworks/torch/hpu/__init__.py)."""
    _import_double(monkeypatch, lazy=False)
    import habana_frameworks.torch.hpu as hthpu

    assert not hasattr(hthpu, "wrap_in_hpu_graph")
    _import_double(monkeypatch, lazy=True)
    import habana_frameworks.torch.hpu as hthpu

    assert callable(hthpu.wrap_in_hpu_graph) and callable(hthpu.input_hash)
    _forget_habana()


def test_unset_lazy_mode_is_eager(hf):
    """Synapse 1.21+: PT_HPU_LAZY_MODE unset means eager. No mark_step, no wrap_in_hpu_graph lookup, and
    --use_hpu_graphs is one line naming the variable to set (not "run inside Habana's container")."""
    assert "PT_HPU_LAZY_MODE" not in os.environ
    rt = get_runtime("hpu")
    from habana_frameworks.torch.utils.internal import is_lazy

    assert not is_lazy() and not rt.lazy_mode
    rt.mark_step()
    assert rt.layer_hook() is None
    with pytest.raises(ValueError, match="set PT_HPU_LAZY_MODE=1"):
        rt.graph_module(_Step(), "decode", {"use_hpu_graphs": True})
    assert hf.CALLS == []  # not even the eager no-op mark_step


@pytest.mark.parametrize("env, bridge", [("0", True), ("1", False)])
def test_lazy_mode_is_habanas_answer(hf, monkeypatch, env, bridge):
    """The bridge read PT_HPU_LAZY_MODE when it was imported and keeps that answer (is_lazy caches it): the runtime
    asks is_lazy(), not the environment."""
    from habana_frameworks.torch.utils import internal

    monkeypatch.setattr(internal.is_lazy, "_is_lazy", bridge)
    monkeypatch.setenv("PT_HPU_LAZY_MODE", env)
    rt = get_runtime("hpu")
    assert rt.lazy_mode is bridge
    rt.mark_step()
    assert _names(hf) == (["mark_step"] if bridge else [])


def test_torch_compile_uses_hpu_backend_in_eager_mode(hf, eager):
    """The runtime names hpu_backend, which torch.compile resolves once the bridge is imported (the double lowers the
    graph through AOT autograd as the real one does): the ATen graph reaches the backend, and a graph on host
    tensors is refused."""
    no_default_device()  # dynamo traces into a default-device mode's tensor constructors
    rt = get_runtime("hpu")
    assert rt.compile_backend() == "hpu_backend"
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2 + 1, backend=rt.compile_backend())
    x = torch.ones(3, device="hpu")
    torch.testing.assert_close(fn(x).cpu(), torch.full((3,), 3.0, device="cpu"))
    assert hf.calls("hpu_backend.graph")[0][0][0] == ["aten.mul.Tensor", "aten.add.Tensor"]
    torch._dynamo.reset()
    with pytest.raises(Exception, match="not an HPU tensor"):
        torch.compile(lambda x: x * 2 + 1, backend="hpu_backend")(torch.ones(3, device="cpu"))
    torch._dynamo.reset()


def test_torch_compile_refused_in_lazy_mode(hf, lazy):
    with pytest.raises(ValueError) as err:
        get_runtime("hpu").compile_backend()
    msg = str(err.value)
    assert "PT_HPU_LAZY_MODE=0" in msg and "\n" not in msg


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_set_kernels_torch_compile_on_hpu(monkeypatch, mode):
    """loading.set_kernels compiles with the runtime's backend: the whole decoder with hpu_backend in eager mode (as
    optimum-habana; tests/test_hpu_compile.py runs it), one error line naming PT_HPU_LAZY_MODE=0 in lazy mode (the
    CLI prints it as its one error: line)."""
    import transformers

    from polyfuse.core.registry import Kernels
    from polyfuse.loader import load as loading
    from polyfuse.models.llama import LlamaForCausalLM

    _import_double(monkeypatch, lazy=mode == "lazy")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM.from_config(cfg)
    backends = []
    monkeypatch.setattr(loading, "get_runtime", lambda device: HpuRuntime(HPU))
    monkeypatch.setattr(Kernels, "compiled", lambda self, backend="inductor", dynamic=None: backends.append(backend)
                        or self)  # fmt: skip
    monkeypatch.setattr(torch, "compile", lambda fn, backend=None, **kw: backends.append(("decoder", backend)) or fn)
    try:
        if mode == "lazy":
            with pytest.raises(ValueError, match="PT_HPU_LAZY_MODE=0"):
                loading.set_kernels(model, {"torch_compile": True})
            assert backends == []
        else:
            loading.set_kernels(model, {"torch_compile": True})
            assert backends == [("decoder", "hpu_backend")]  # one compile: the decoder, not the ops one by one
    finally:
        _forget_habana()


def test_double_hpu_graph_semantics(hf, lazy):
    """The double's graphs behave like Habana's: keyed on shape and view offset, inputs copied into the capture-time
    tensors on replay, the same output objects returned every time, Python ints keyed by value."""
    from habana_frameworks.torch.hpu import wrap_in_hpu_graph

    m = _Step()
    wrap_in_hpu_graph(m)
    base = torch.randn(3, 4)
    with torch.no_grad():
        y0 = m(base[0:1])
        m(base[1:2])  # same shape, another view offset: a second graph
        x = torch.randn(1, 4)
        y = m(x)  # the key of base[0:1]: a replay that copies x into base[0:1]
    assert [n for n in _names(hf) if n.startswith("hpu_graph")] == ["hpu_graph_capture"] * 2 + ["hpu_graph_replay"]
    assert y is y0 and torch.equal(base[0], x[0])
    torch.testing.assert_close(y, m.lin(x))
    hf.reset()

    class _Sized(torch.nn.Module):
        def forward(self, n: int, x):
            return x[:, :n] * 2

    s = wrap_in_hpu_graph(_Sized())
    x = torch.randn(2, 8)
    for n in (4, 4, 8, 4):
        torch.testing.assert_close(s(n, x), x[:, :n] * 2)
    assert [n for n in _names(hf) if n.startswith("hpu_graph")] == [
        "hpu_graph_capture", "hpu_graph_replay", "hpu_graph_capture", "hpu_graph_replay"
    ]  # fmt: skip


# -- runtime: mark_step placement, sync, memory --------------------------------------------------------------------------


def test_mark_step_in_lazy_mode(hf, lazy):
    rt = get_runtime("hpu")
    rt.mark_step()
    hook = rt.layer_hook()
    assert hook is not None
    for _ in range(3):  # the model calls it before every decoder layer
        hook()
    assert _names(hf).count("mark_step") == 4


def test_no_mark_step_in_eager_mode(hf, eager):
    rt = get_runtime("hpu")
    rt.mark_step()
    assert rt.layer_hook() is None
    assert "mark_step" not in _names(hf)


def test_no_mark_step_on_cpu_runtime(hf, lazy):
    rt = get_runtime("cpu")
    assert type(rt) is DeviceRuntime
    rt.mark_step()
    assert rt.layer_hook() is None
    assert rt.graph_module(_Step(), "decode", {"use_hpu_graphs": True}) is not None
    assert hf.CALLS == []


def test_runtime_without_habana_is_harmless(no_habana, lazy):
    rt = get_runtime("hpu")
    rt.mark_step()
    rt.synchronize()
    rt.reset_peak_memory()
    assert rt.layer_hook() is None
    assert "max_memory_allocated (GB)" in rt.memory_stats()


def test_memory_stats_format(hf):
    gb = 1024**3
    import habana_frameworks.torch.hpu as hthpu

    hthpu.MEMORY.update(InUse=int(17.56 * gb) + 5, MaxInUse=int(19.423 * gb), Limit=int(94.62 * gb) + 7)
    rt = get_runtime("hpu")
    stats = rt.memory_stats()
    assert stats == {
        "memory_allocated (GB)": 17.56,
        "max_memory_allocated (GB)": 19.42,
        "total_memory_available (GB)": 94.62,
    }
    assert hf.calls("memory_stats")[0][0] == (rt.device,)
    lines = ["{:35} = {} GB".format(k[:-5].replace("_", " ").capitalize(), v) for k, v in stats.items()]
    assert lines[0] == "Memory allocated                    = 17.56 GB"
    assert lines[2] == "Total memory available              = 94.62 GB"
    rt.reset_peak_memory()
    assert rt.memory_stats()["max_memory_allocated (GB)"] == 17.56
    rt.synchronize()
    assert "synchronize" in _names(hf)


# -- fused optimizer helpers -----------------------------------------------------------------------------------------


def test_fused_adamw(hf):
    model = torch.nn.Linear(4, 2)
    opt = fused_adamw(model.parameters(), lr=1e-2, weight_decay=0.1)
    assert type(opt).__module__ == "habana_frameworks.torch.hpex.optimizers"
    assert hf.calls("FusedAdamW")[0][1]["lr"] == 1e-2 and hf.calls("FusedAdamW")[0][1]["eps"] == 1e-6
    before = model.weight.detach().clone()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert not torch.equal(before, model.weight)


def test_fused_clip_norm(hf):
    model = torch.nn.Linear(4, 2)
    clipper = fused_clip_norm(model.parameters(), 0.5)
    (model(torch.randn(8, 4)) * 10).sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    norm = clipper.clip_norm(model.parameters())
    torch.testing.assert_close(norm, expected)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert math.isclose(float(clipped), 0.5, rel_tol=1e-4)


def test_fused_optim_helpers_without_habana(no_habana):
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert fused_adamw(params, lr=1e-3) is None
    assert fused_clip_norm(params, 1.0) is None


def test_double_fused_adamw_is_strict(hf):
    from habana_frameworks.torch.hpex.optimizers import FusedAdamW

    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(RuntimeError, match="empty"):
        FusedAdamW([{"params": [w], "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}])
    with pytest.raises(TypeError):
        FusedAdamW([w], amsgrad=True)  # torch-only keyword: not in Habana's signature


def test_fused_adamw_drops_empty_groups(hf):
    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = fused_adamw(iter([{"params": iter([w]), "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}]), lr=1)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == [w]
    assert fused_adamw([{"params": []}], lr=1) is None
    assert len(fused_adamw([b], lr=1).param_groups) == 1


class _LoraLike(torch.nn.Module):
    """Trainable weights only (LoRA-like): biases and norms frozen, so the no-decay group is empty."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        for p in (self.lin.bias, self.norm.weight, self.norm.bias):
            p.requires_grad_(False)

    def forward(self, x):
        return self.norm(self.lin(x))


@pytest.mark.parametrize("eps, want", [(None, 1e-6), (1e-7, 1e-7)])
def test_trainer_fused_adamw_drops_empty_groups_and_uses_habanas_eps(hf, eager, monkeypatch, tmp_path, eps, want):
    """PolyfuseTrainer.create_optimizer with use_fused_adam, as optimum-habana's GaudiTrainer: no empty parameter
    group (they crash FusedAdamW) and eps 1e-6 unless set (GaudiTrainingArguments' default), an explicit one wins."""
    from polyfuse.training import PolyfuseTrainer, PolyfuseTrainingArguments, arguments
    from polyfuse.training.gaudi_config import GaudiConfig

    monkeypatch.setattr(arguments, "hpu_available", lambda: True)
    kw = {} if eps is None else {"adam_epsilon": eps}
    args = PolyfuseTrainingArguments(output_dir=str(tmp_path), use_habana=True, report_to=[], use_cpu=True, **kw)
    assert args.use_lazy_mode is False  # the double's bridge runs in eager mode here
    trainer = PolyfuseTrainer(_LoraLike(), args, gaudi_config=GaudiConfig(use_fused_adam=True))
    trainer.runtime = HpuRuntime(HPU)  # the Trainer runs on the CPU here; the runtime is the Gaudi one
    opt = trainer.create_optimizer()
    assert type(opt).__module__ == "habana_frameworks.torch.hpex.optimizers"
    assert [len(g["params"]) for g in opt.param_groups] == [1]
    assert hf.calls("FusedAdamW")[0][1]["eps"] == want


def test_use_lazy_mode_follows_the_bridge(hf, lazy, monkeypatch, tmp_path):
    from polyfuse.training import PolyfuseTrainingArguments, arguments

    monkeypatch.setattr(arguments, "hpu_available", lambda: True)
    args = PolyfuseTrainingArguments(output_dir=str(tmp_path), use_habana=True, report_to=[], use_cpu=True)
    assert args.use_lazy_mode is True
    from habana_frameworks.torch.utils import internal

    monkeypatch.setattr(internal.is_lazy, "_is_lazy", False)
    args = PolyfuseTrainingArguments(output_dir=str(tmp_path), use_habana=True, report_to=[], use_cpu=True)
    assert args.use_lazy_mode is False
    with pytest.raises(ValueError, match="PT_HPU_LAZY_MODE=1"):
        PolyfuseTrainingArguments(
            output_dir=str(tmp_path), use_habana=True, use_lazy_mode=True, report_to=[], use_cpu=True
        )


# -- training through the HPU backend (test double) ------------------------------------------------------------------

TRAIN_FLAGS = {
    "use_flash_attention": True,
    "flash_attention_causal_mask": True,
    "flash_attention_recompute": True,
    "flash_attention_fast_softmax": True,
}


def _tiny_cfg(**kw):
    import transformers

    base = dict(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _on_hpu_backend(model, flags, training=False):
    """The model moved to the HPU (the double's under ``hf``) with its kernels resolved there for ``flags``."""
    from polyfuse.loader import load as loading

    model = model.to("hpu")
    model.init_buffers(model.device)
    loading.set_kernels(model, dict(flags), training=training)
    return model


def test_polyfuse_model_trains_right_padded_batch_through_fused_sdpa(hf, lazy):
    """A training step on a right-padded batch (what collators give) with every FusedSDPA flag on: no lengths reach
    the kernel while gradients are on (the real kernel asserts), and loss and gradients equal the native model's."""
    from polyfuse.models.llama import LlamaForCausalLM

    cfg = _tiny_cfg()
    ids = torch.randint(10, 100, (2, 8), generator=torch.Generator().manual_seed(0), device="cpu")
    mask = torch.ones(2, 8, dtype=torch.long, device="cpu")
    mask[1, 5:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    ref = LlamaForCausalLM.from_config(cfg, seed=4, training=True)
    model = _on_hpu_backend(LlamaForCausalLM.from_config(cfg, seed=4, training=True), TRAIN_FLAGS, training=True)
    assert model.kernels.choices["attention"].implementation.name == "fused_sdpa"
    hf.reset()
    losses = []
    for m in (ref, model):
        loss = m(ids.to(m.device), attention_mask=mask.to(m.device), labels=labels.to(m.device)).loss
        loss.backward()
        losses.append(loss.cpu())
    torch.testing.assert_close(losses[1], losses[0], **TOL[torch.float32])
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-5, rtol=1e-4, msg=n)
    sdpa = hf.calls("FusedSDPA")
    assert len(sdpa) == cfg.num_hidden_layers
    for args, _ in sdpa:
        assert args[9] is None and args[3] is not None and args[5] is False


def test_patch_path_keeps_the_padding_mask(hf, lazy):
    """transformers' Llama patched for an HPU run with --flash_attention_causal_mask: the padding mask reaches
    FusedSDPA (there are no lengths on this path) and the logits of the real tokens equal the unpatched model's."""
    from helpers import tiny_llama

    from polyfuse.patch import patch

    with torch.device("cpu"):
        model = tiny_llama(seed=0).eval()
        ids = torch.randint(10, 200, (2, 8), generator=torch.Generator().manual_seed(1))
        mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    flags = {"use_flash_attention": True, "flash_attention_causal_mask": True}
    model.to("hpu")
    handle = patch(model, device="hpu", flags=flags, training=False)
    assert handle.kernels.choices["attention"].implementation.name == "fused_sdpa"
    hf.reset()
    with torch.no_grad():
        got = model(ids.to("hpu"), attention_mask=mask.to("hpu")).logits.cpu()
    sdpa = hf.calls("FusedSDPA")
    assert sdpa and all(args[3] is not None and args[5] is False for args, _ in sdpa)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], atol=1e-4, rtol=1e-4)


# -- device hpu from Python: the bridge import, sampling generators ---------------------------------------------------


def test_hpu_runtime_imports_the_bridge(hf_bare):
    """Asking for device hpu imports habana_frameworks.torch (which registers the device with torch), as
    optimum-habana's setup_device does; nobody has to import it first."""
    assert "habana_frameworks.torch" not in sys.modules
    get_runtime("hpu")
    assert "habana_frameworks.torch" in sys.modules


class _Stop(Exception):
    pass


def test_from_config_on_hpu_imports_the_bridge_before_allocating(hf_bare, monkeypatch):
    from polyfuse.models.llama import LlamaForCausalLM

    seen = []

    def to_empty(self, *, device, recurse=True):
        seen.append("habana_frameworks.torch" in sys.modules)
        raise _Stop

    monkeypatch.setattr(torch.nn.Module, "to_empty", to_empty)
    with pytest.raises(_Stop):
        LlamaForCausalLM.from_config(_tiny_cfg(), device="hpu")
    assert seen == [True]


def test_sampling_with_a_generator_on_another_device(monkeypatch):
    """run_generation keeps a CPU torch.Generator for HPU runs, and torch.multinomial refuses a generator of another
    device than its input: sampling draws on the generator's device and returns the token on the logits' device.
    (No second device on a CPU machine: the generator claims to live on "meta"; the real pairing is HPU logits with
    a CPU generator, or CUDA ones in test_sampling_cpu_generator_with_cuda_logits.)"""
    from polyfuse.generation.sampling import next_token

    calls = []

    def multinomial(probs, n, generator=None):
        calls.append((probs.device.type, generator.device.type))
        if probs.device.type != generator.device.type:
            raise RuntimeError(f"generator on {generator.device.type}, input on {probs.device.type}")
        return torch.zeros(probs.shape[0], n, dtype=torch.long)  # what a draw on the generator's device gives back

    monkeypatch.setattr(torch, "multinomial", multinomial)
    logits = torch.randn(3, 11)
    elsewhere = type("Generator", (), {"device": torch.device("meta")})()
    tok = next_token(logits, do_sample=True, generator=elsewhere)
    assert calls == [("meta", "meta")] and tok.device == logits.device and tok.shape == (3,)


@pytest.mark.cuda
def test_sampling_cpu_generator_with_cuda_logits():
    from polyfuse.generation.sampling import next_token

    logits = torch.randn(3, 11, device="cuda")
    a = next_token(logits, do_sample=True, generator=torch.Generator().manual_seed(0))
    b = next_token(logits, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert a.device == logits.device and torch.equal(a, b)


# -- real Gaudi ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def gaudi():
    _habana.clear_cache()
    import habana_frameworks.torch  # noqa: F401  (registers the hpu device with torch)

    assert not getattr(sys.modules["habana_frameworks"], "TEST_DOUBLE", False)
    return torch.device("hpu")


@pytest.mark.hpu
@needs_gaudi
def test_gaudi_fused_rms_norm_and_rope_vs_native(gaudi):
    x = torch.randn(2, 16, 256, dtype=torch.bfloat16, device=gaudi)
    w = torch.randn(256, dtype=torch.bfloat16, device=gaudi)
    torch.testing.assert_close(fused_rms_norm(x, w, 1e-6).cpu(), rms_norm_native(x, w, 1e-6).cpu(), **TOL[x.dtype])
    q, k, _ = (t.to(gaudi) for t in _qkv(b=2, hq=8, hkv=2, lq=16, lk=16, d=64, dtype=torch.bfloat16))
    cos, sin = (t.to(gaudi) for t in _cos_sin(2, 16, 64, offset=5))
    for a, b in zip(fused_rope(q, k, cos, sin), rotary_native(q, k, cos, sin)):
        torch.testing.assert_close(a.cpu(), b.cpu(), **TOL[torch.bfloat16])


@pytest.mark.hpu
@needs_gaudi
def test_gaudi_runtime(gaudi):
    rt = get_runtime(gaudi)
    if not rt.lazy_mode:
        pytest.skip("HPU graphs need a process started with PT_HPU_LAZY_MODE=1")
    m = _Step().to(gaudi)
    step = rt.graph_module(m, "decode", {"use_hpu_graphs": True})
    x = torch.randn(2, 4, device=gaudi)
    for _ in range(3):
        y = step(x)
        rt.mark_step()
    torch.testing.assert_close(y.cpu(), m.lin(x).cpu())
    rt.synchronize()
    stats = rt.memory_stats()
    assert set(stats) == {"memory_allocated (GB)", "max_memory_allocated (GB)", "total_memory_available (GB)"}
    assert stats["total_memory_available (GB)"] > 0


# -- the whole generation loop through the HPU backend ----------------------------------------------------------------


def _graph_keys(step) -> list:
    """Habana's own graph-cache key (``hpu.graphs.input_hash``) of every non-bypassed call of a module wrapped by
    wrap_in_hpu_graph: the number of distinct keys is the number of graphs it captures (double and Gaudi alike)."""
    from habana_frameworks.torch.hpu.graphs import input_hash

    module, keys = step.module, []
    inner = module.forward

    def spy(*args, **kwargs):
        if not kwargs.get("bypass_hpu_graphs"):
            keys.append(input_hash((args, kwargs)))
        return inner(*args, **kwargs)

    module.forward = spy
    return keys


GEN_FLAGS = [
    {},
    {"use_flash_attention": True, "flash_attention_causal_mask": True, "flash_attention_recompute": True},
    {"use_flash_attention": True, "use_hpu_graphs": True, "limit_hpu_graphs": True},
    {"use_hpu_graphs": True, "attn_softmax_bf16": True},
]
GEN_IDS = ["plain", "flash-causal-recompute", "flash-graphs-limit", "graphs-eager-attention"]


@pytest.mark.parametrize("habana", BACKENDS, indirect=True)
@pytest.mark.parametrize("flags", GEN_FLAGS, ids=GEN_IDS)
@pytest.mark.parametrize("bucket_size", [-1, 4])
def test_generation_through_hpu_backend(habana, flags, bucket_size):
    """polyfuse's Llama generating with the kernels and runtime the registry gives an HPU run, in lazy and in eager
    mode: Habana's entry points receive the calls (FusedSDPA with the right mode per step, FusedRMSNorm, FusedRoPE,
    HPU graphs, mark_step in lazy mode only), HPU graphs capture at most one graph per KV bucket plus one for the
    prompt (the cache position is one tensor advanced in place), and the greedy tokens equal the native run's."""
    from polyfuse.generation.kv_cache import bucketed
    from polyfuse.generation.steps import model_steps
    from polyfuse.loader import load as loading
    from polyfuse.models.llama import LlamaForCausalLM

    cfg = _tiny_cfg()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    n, new_tokens = ids.shape[1], 10
    kw = dict(max_new_tokens=new_tokens, ignore_eos=True, bucket_size=bucket_size)
    graphs = bool(flags.get("use_hpu_graphs"))
    dev = habana.device
    model = LlamaForCausalLM.from_config(cfg, seed=4).to(dev).eval()
    if habana.double is not None:
        want = LlamaForCausalLM.from_config(cfg, seed=4).eval().generate(ids, mask, **kw)
        if graphs and not habana.lazy:  # refused when the kernels are set, before anything runs
            with pytest.raises(ValueError, match="set PT_HPU_LAZY_MODE=1"):
                _on_hpu_backend(model, flags)
            assert "wrap_in_hpu_graph" not in _names(habana.double)
            return
        _on_hpu_backend(model, flags)
        habana.double.reset()
    else:  # a real Gaudi: the same kernels without graphs are the reference for the graphed run
        plain = {k: v for k, v in flags.items() if k not in ("use_hpu_graphs", "limit_hpu_graphs")}
        loading.set_kernels(model, plain)
        want = model.generate(ids.to(dev), mask.to(dev), **kw).cpu()
        loading.set_kernels(model, flags)
    assert model.runtime.lazy_mode is habana.lazy

    if graphs and not habana.lazy:
        with pytest.raises(ValueError, match="set PT_HPU_LAZY_MODE=1"):
            model.generate(ids.to(dev), mask.to(dev), **kw)
        if habana.double is not None:
            assert habana.double.CALLS == []  # nothing ran, wrap_in_hpu_graph was not even looked up
        return
    decode = model_steps(model).decode
    keys = _graph_keys(decode) if graphs else []
    got = model.generate(ids.to(dev), mask.to(dev), **kw)
    assert torch.equal(got.cpu(), want)

    kv_lens = {bucketed(n + i + 1, bucket_size, model.cache.max_len) for i in range(new_tokens - 1)}
    if bucket_size <= 0:
        kv_lens = {model.cache.max_len}
    if graphs:
        prompt_graphs = 0 if flags.get("limit_hpu_graphs") else 1
        assert len(set(keys)) == len(kv_lens) + prompt_graphs  # one per KV bucket, plus the prompt's
        assert len(keys) == new_tokens - 1 + prompt_graphs  # every step went through the graphs
    if habana.double is None:
        return
    names = _names(habana.double)
    assert names.count("FusedRMSNorm") > 0 and names.count("RotaryPosEmbeddingHelperV2") > 0
    # Lazy: mark_step after each token and before each of 2 layers in each forward the Python runs: all 10 (1 prefill
    # + 9 decode steps) without graphs; with them only the captures and the bypassed prompt (a replay runs no Python).
    python_forwards = len(set(keys)) + bool(flags.get("limit_hpu_graphs")) if graphs else new_tokens
    assert names.count("mark_step") == (new_tokens + 2 * python_forwards if habana.lazy else 0)
    assert "mark_step_in_eager_mode" not in names
    sdpa = habana.double.calls("FusedSDPA")
    if flags.get("use_flash_attention"):
        assert len(sdpa) == 2 * python_forwards
        prefill_args, decode_args = sdpa[0][0], sdpa[-1][0]
        assert decode_args[4:] == (0.0, False, None, "None", False, None, "None") and decode_args[3] is not None
        assert decode_args[1].shape[1] == cfg.num_key_value_heads  # GQA: the cache slice itself, unrepeated
        if flags.get("flash_attention_causal_mask"):
            assert prefill_args[3] is None and prefill_args[5] is True and prefill_args[8] is True
            assert prefill_args[10] == "left"
            assert prefill_args[9].tolist() == [4, 6] and prefill_args[9].dtype == torch.int32  # valid lengths
    else:
        assert sdpa == []
    captured = [n for n in names if n.startswith("hpu_graph")]
    if graphs:
        assert captured.count("hpu_graph_capture") == len(set(keys))
        assert len(habana.double.calls("wrap_in_hpu_graph")) == 1
    else:
        assert captured == [] and "wrap_in_hpu_graph" not in names


@pytest.mark.parametrize(
    "mode,flags,needle",
    [
        ("eager", {"use_hpu_graphs": True}, "PT_HPU_LAZY_MODE=1"),
        ("lazy", {"torch_compile": True}, "PT_HPU_LAZY_MODE=0"),
    ],
)
def test_flag_checks_refuse_what_the_mode_cannot_run_before_loading(monkeypatch, mode, flags, needle):
    """--use_hpu_graphs in eager mode / --torch_compile in lazy mode: one line naming what to set, from the flag
    check that runs before the model is loaded (not at the first generate)."""
    from polyfuse.core.flags import check_flags

    _import_double(monkeypatch, mode == "lazy")
    with pytest.raises(ValueError, match=needle):
        check_flags("hpu", flags)
    ok, _ = check_flags("hpu", {"use_hpu_graphs": mode == "lazy", "torch_compile": mode == "eager"})
    assert ok["use_hpu_graphs"] == (mode == "lazy")
    _forget_habana()
