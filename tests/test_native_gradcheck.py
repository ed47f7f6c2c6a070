"""Every native reference op's backward, checked by finite differences in float64 (torch.autograd.gradcheck).
The kernels' gradients are then checked against these references (tests/test_kernels_conformance.py)."""

import torch
from torch.autograd import gradcheck

from polyfuse.ops.add_rms_norm import add_rms_norm_native
from polyfuse.ops.attention import AttentionMeta, attention_native, causal_mask
from polyfuse.ops.linear_cross_entropy import linear_cross_entropy_native
from polyfuse.ops.rms_norm import rms_norm_native
from polyfuse.ops.rotary import rotary_native
from polyfuse.ops.swiglu import swiglu_native


G = torch.Generator().manual_seed(0)


def _r(*shape):
    return torch.randn(*shape, generator=G, dtype=torch.float64).requires_grad_()


def test_rms_norm():
    assert gradcheck(lambda x, w: rms_norm_native(x, w, 1e-6), (_r(3, 5, 8), _r(8)))


def test_add_rms_norm():
    assert gradcheck(lambda x, r, w: add_rms_norm_native(x, r, w, 1e-6), (_r(2, 4, 8), _r(2, 4, 8), _r(8)))


def test_rotary():
    cos, sin = (
        torch.randn(2, 3, 8, generator=G, dtype=torch.float64),
        torch.randn(2, 3, 8, generator=G, dtype=torch.float64),
    )
    assert gradcheck(lambda q, k: rotary_native(q, k, cos, sin), (_r(2, 4, 3, 8), _r(2, 2, 3, 8)))


def test_swiglu():
    assert gradcheck(swiglu_native, (_r(3, 7), _r(3, 7)))


def test_attention_gqa_with_padding_mask():
    mask = causal_mask(5, 5, "cpu", torch.float64).expand(2, 1, 5, 5).clone()
    mask[1, :, :, :2] = torch.finfo(torch.float64).min  # row 1 left-padded by two
    mask[1, :, :2, 0] = 0  # padded queries see something (their output is ignored, but keep it finite)
    meta = AttentionMeta(scale=0.3, mask=mask)
    assert gradcheck(lambda q, k, v: attention_native(q, k, v, meta), (_r(2, 4, 5, 6), _r(2, 2, 5, 6), _r(2, 2, 5, 6)))


def test_linear_cross_entropy_with_ignored_labels():
    labels = torch.tensor([3, -100, 0, 9, 9, -100])
    assert gradcheck(lambda h, w: linear_cross_entropy_native(h, w, labels), (_r(6, 5), _r(11, 5)))
    assert gradcheck(lambda h, w: linear_cross_entropy_native(h, w, labels, reduction="sum"), (_r(6, 5), _r(11, 5)))


def test_lora_linear_with_dropout_and_trainable_base():
    """Two adapters on row ranges of one weight, dropout 0.4 (the same seed on every evaluation, so the same mask),
    every input trainable, base weight and bias included."""
    from polyfuse.ops.lora_linear import LoraAdapter, lora_linear_native

    def fn(x, w, b, a1, b1, a2, b2):
        torch.manual_seed(3)
        adapters = (LoraAdapter(0, 4, a1, b1, 1.5, 0.4), LoraAdapter(6, 9, a2, b2, 0.5, 0.0))
        return lora_linear_native(x, w, b, adapters)

    args = (_r(2, 3, 5), _r(9, 5), _r(9), _r(2, 5), _r(4, 2), _r(3, 5), _r(3, 3))
    assert gradcheck(fn, args)
