"""fp8 projections on Gaudi: Habana's fp8 GEMM, the activations quantized per token, as Intel Neural Compressor's
dynamic fp8 quantization runs a Linear on Gaudi (``PatchedLinear.run_linear_quant`` with ``QuantDynamicInput`` and the
per-token ``MaxAbsDynamicPcs`` scales; what optimum-habana's ``QUANT_CONFIG`` fp8 path patches a model with):

    scale = max(amax(|x| per row) / (fullscale * 0.5), bf16 tiny)    # [M, 1], float32
    x8    = torch.ops.hpu.cast_to_fp8_v2(x, 1 / scale, False, False, torch.float8_e4m3fn)[0]
    y     = torch.ops.hpu.fp8_gemm_v2(x8, False, w_t, False, None, x.dtype, scale, w_scales, None, False) + bias

``fullscale`` is e4m3's largest value on the device: 240 on Gaudi2, 448 on Gaudi3 (INC's ``get_fullscale``,
optimum-habana's fine-grained fp8 quantizer); 0.5 is INC's backoff for dynamic scales (``ScaleMethodFactory``: each
row's largest value lands at half the range). INC computes the scale in the activations' dtype and may round it (its
scale rounding method); here it stays float32, unrounded. The GEMM call is INC's own form: ``PatchedLinearBase``
replaces the weight by ``weight.t().contiguous()`` ([K, N]) once, and ``QuantizedHpuMatmul`` calls ``fp8_gemm_v2``
with ``trans_A=False, trans_B=False`` and the per-channel weight scales. polyfuse's loaded weight stays [N, K] (saving,
dequantizing and the other kernels read it), so its [K, N] copy is made once per weight where the run's ``linear_q``
chain has this kernel (``prepare``, from ``HpuRuntime.adapt_quantized``; else on the first call), kept beside the
buffers and remade when the weight is replaced or changed in place: **on Gaudi an fp8 model holds its weights twice**.
Weights are within the device's range: made on a Gaudi2 they are scaled to 240, and loaded ones beyond it are halved
by the runtime (fp8_range.py), before the copy is made. It takes per-channel ``fp8`` weights with bfloat16 or float32
activations in inference; fp8_block (1 x 128 scales), other dtypes and calls that need gradients are declined to the
next choice (the native reference: dequantize + ``F.linear``). Like cuda:scaled_mm it is W8A8: its results differ
from the weight-only reference by the e4m3 rounding of the activations.

Written against the schemas of Habana's bridge and INC's calls; exercised by the test double (tests/habana_double),
never run on a Gaudi.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from polyfuse.backends.hpu import _habana
from polyfuse.backends.hpu.fp8_range import device_fp8_max
from polyfuse.backends.hpu.linear_inputs import declined_inputs
from polyfuse.core.registry import Planned
from polyfuse.ops.quant_formats import FP8, FP8_MAX


OPS = ("cast_to_fp8_v2", "fp8_gemm_v2")
_TINY = torch.finfo(torch.bfloat16).tiny  # INC's floor for a per-channel / per-token scale
BACKOFF = 0.5  # INC's for dynamic (per-call) scales


def _op(name: str):
    try:
        return getattr(torch.ops.hpu, name)
    except (AttributeError, RuntimeError):
        return None


def missing_reason() -> Optional[str]:
    """None when Habana's fp8 GEMM can run here, else why not (the bridge is imported first: the ops live in it)."""
    if not _habana.import_bridge():
        return f"{_habana.BRIDGE} not importable"
    absent = [name for name in OPS if _op(name) is None]
    if absent:
        return f"torch.ops.hpu has no {', '.join(absent)} in this Habana build"
    if _habana.generation() == "gaudi":
        return "first-generation Gaudi has no fp8 GEMM"
    return None


def fullscale() -> float:
    """e4m3's largest value on this Gaudi: 240 on Gaudi2, 448 on Gaudi3 (and where the bridge does not say)."""
    return device_fp8_max() or FP8_MAX


def accepts_linear_q(x, qweight, bias=None) -> Optional[str]:
    if qweight.format == "fp8_block":
        return "fp8_block weights (takes per-channel fp8)"
    if qweight.format != "fp8":
        return Planned(f"{qweight.format} weights (takes per-channel fp8)")  # another kernel's, or the reference's
    return declined_inputs(x, qweight, bias)


def quantize_rows(x2: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) by Habana's cast, one scale per row (token), its largest
    value at ``top * BACKOFF``."""
    amax = x2.abs().amax(-1, keepdim=True).float()
    scale = torch.clamp(amax / (top * BACKOFF), min=_TINY)
    return torch.ops.hpu.cast_to_fp8_v2(x2, 1.0 / scale, False, False, FP8)[0], scale


_TRANSPOSED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # the module's qweight -> ((id, version), its [K, N] copy)


def _tag(t: torch.Tensor):
    return id(t), (None if t.is_inference() else t._version)


def prepare(qw) -> torch.Tensor:
    """The weight as INC hands it to the GEMM, ``qweight.t().contiguous()`` [K, N]: made once per weight, remade when
    the buffer changes (another tensor, or written in place: the version counter moved)."""
    got = _TRANSPOSED.get(qw.qweight)
    if got is None or got[0] != _tag(qw.qweight):
        got = _TRANSPOSED[qw.qweight] = (_tag(qw.qweight), qw.qweight.t().contiguous())
    return got[1]


def fp8_gemm(x, qweight, bias=None):
    """``linear_q`` on Habana's fp8 GEMM: x [..., K] @ dequantize(qweight).T -> [..., N] in x's dtype (+ bias)."""
    n, k = qweight.shape
    x2 = x.reshape(-1, k)
    x8, scale = quantize_rows(x2, fullscale())
    y = torch.ops.hpu.fp8_gemm_v2(x8, False, prepare(qweight), False, None, x.dtype, scale, qweight.scales.float(),
                                  None, False)  # fmt: skip
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)
