"""int4 projections on Gaudi: Habana's 4-bit dequantization, then one matmul, as Intel Neural Compressor's
``HPUWeightOnlyLinear`` and AutoGPTQ's HPU ``QuantLinear`` (optimum-habana's ``--load_quantized_model_with_autogptq``)
run a GPTQ checkpoint on Gaudi, in INC's form of the call:

    w = torch.ops.hpu.convert_from_uint4(qweight_hpu, scales_bf16, zeros_hpu, torch.bfloat16)     # [K, N]
    y = x @ w  (+ bias)

Habana packs eight values of one row along the last dimension: ``qweight_hpu`` int32 [K, N / 8], weight (k, n) in
bits 4 (n % 8) .. of word [k, n // 8], and the zero points the same way, ``zeros_hpu`` int32 [G, N / 8], holding the
true zeros (AutoGPTQ's stored minus one undone, as INC and AutoGPTQ's HPU module store them). AutoGPTQ's layout, which
the module keeps (polyfuse/ops/quant_formats.py), packs eight rows of K per word ([K / 8, N]). The repacked copy is
made once per weight by ``HpuRuntime.adapt_quantized`` after loading, where the run's ``linear_q`` chain has this
kernel and the run is bfloat16 (else on the weight's first call), and kept beside the buffers: **on Gaudi an int4
model holds its packed weights twice** (a quarter of bf16 each). It is remade when qweight, qzeros or g_idx is replaced
(another tensor) or changed in place (its version counter moved; writes through ``.data`` and to tensors made under
``inference_mode``, which have no counter, are not seen). The scales go in as bfloat16, as INC stores them, cast once
per scales tensor and version: AutoGPTQ's float16 scales rounded to 8 significant bits (at most 2^-9 of each).

The bridge's 4-argument op (Synapse up to 1.22; the group index came later) broadcasts a [G, N] scale over blocks of
K / G consecutive rows. Declined to the native reference:

* a last partial group (K not a multiple of the group size): the op's blocks are K / G rows;
* a zero point of 16 (a stored 15, which polyfuse's reference reads as 16; polyfuse's quantizer never makes one):
  4-bit packed zeros hold 0..15;
* act-order groups of uneven size (act-order checkpoints otherwise run with their rows sorted by group once at
  repacking and the activations' columns gathered in that order per call, ``x[..., perm]``: the same sum, reordered);
* activations other than bfloat16 (INC's only dtype for this op; float32 and float16 output of the 4-argument op are
  not known to run) and calls that need gradients.

The dtype declines are planned (the loader says once that such a run dequantizes: quant/report.py); the
others warn once per cause. Written against the bridge's schema and source and INC's / AutoGPTQ's calls; exercised by
the test double (tests/habana_double), never run on a Gaudi.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from polyfuse.backends.hpu import _habana
from polyfuse.backends.hpu.linear_inputs import declined_inputs
from polyfuse.core.registry import Planned
from polyfuse.ops.quant_formats import QuantizedWeight, unpack_int4


OP = "convert_from_uint4"
DTYPES = (torch.bfloat16,)


@dataclass
class HpuInt4:
    """One int4 weight in Habana's layout, or why it has none."""

    key: tuple  # the buffers it was made from: (id, version) of qweight, qzeros and g_idx
    held: tuple  # those buffers, held so that no other tensor takes their ids while this entry lives
    qweight: Optional[torch.Tensor] = None  # int32 [K, N / 8]
    zeros: Optional[torch.Tensor] = None  # int32 [G, N / 8], the true zero points
    perm: Optional[torch.Tensor] = None  # act-order: the input columns in group order (None: in order already)
    declined: Optional[str] = None
    scales: Optional[tuple] = None  # (the scales tensor, its (id, version), its bfloat16 copy)


_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # QuantizedWeight.qweight (the module's buffer) -> HpuInt4


def missing_reason() -> Optional[str]:
    """None when Habana's 4-bit dequantization can run here, else why not (the bridge is imported first)."""
    if not _habana.import_bridge():
        return f"{_habana.BRIDGE} not importable"
    try:
        getattr(torch.ops.hpu, OP)
    except (AttributeError, RuntimeError):
        return f"torch.ops.hpu has no {OP} in this Habana build"
    return None


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] of 4-bit values -> Habana's int32 [R, C / 8]: value j of each run of 8 along C in bits 4 j.."""
    r, c = q.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return (q.view(r, c // 8, 8).to(torch.int32) << shifts).sum(-1, dtype=torch.int32)


def _tag(t: Optional[torch.Tensor]):
    """(id, version counter) of a tensor; an inference tensor has no counter (None)."""
    if t is None:
        return None
    return id(t), (None if t.is_inference() else t._version)


def _buffers(qw: QuantizedWeight) -> tuple:
    return qw.qweight, qw.qzeros, qw.g_idx


def _current(got: Optional[HpuInt4], qw: QuantizedWeight) -> bool:
    return (
        got is not None
        and all(a is b for a, b in zip(got.held, _buffers(qw)))
        and got.key == tuple(map(_tag, _buffers(qw)))
    )


def _make(qw: QuantizedWeight) -> HpuInt4:
    n, k = qw.shape
    key, held, groups = tuple(map(_tag, _buffers(qw))), _buffers(qw), qw.scales.shape[0]
    if groups * qw.group_size != k:  # the op's blocks are K / G rows: only whole groups of group_size match them
        why = f"a last partial group (in_features {k}, groups of {qw.group_size}): Habana's {OP} takes whole groups"
        return HpuInt4(key, held, declined=why)
    q, zeros = unpack_int4(qw)  # [K, N] in the checkpoint's row order, [G, N] true zeros (1..16)
    if bool((zeros > 15).any()):
        return HpuInt4(key, held, declined="a zero point of 16 (stored 15): Habana's packed zero points hold 0..15")
    perm = None
    if qw.g_idx is not None:
        g = qw.g_idx.long()
        order = torch.arange(k, device=g.device) // qw.group_size
        if not torch.equal(g, order):
            if not torch.equal(torch.bincount(g, minlength=groups), torch.full_like(order[:groups], qw.group_size)):
                return HpuInt4(key, held, declined="act-order groups of uneven size")
            perm = torch.argsort(g, stable=True)
            q = q[perm]
    return HpuInt4(key, held, pack_rows(q), pack_rows(zeros), perm)


def prepare(qw: QuantizedWeight) -> HpuInt4:
    """Habana's layout of ``qw``, made once and remade when its buffers change."""
    got = _PACKED.get(qw.qweight)
    if not _current(got, qw):
        got = _PACKED[qw.qweight] = _make(qw)
    return got


def bf16_scales(packed: HpuInt4, qw: QuantizedWeight) -> torch.Tensor:
    """The scales [G, N] in bfloat16, cast once per scales tensor and version (scale tuning changes them in place)."""
    got = packed.scales
    if got is None or got[0] is not qw.scales or got[1] != _tag(qw.scales):
        got = packed.scales = (qw.scales, _tag(qw.scales), qw.scales.to(torch.bfloat16))
    return got[2]


def accepts_linear_q(x, qweight, bias=None) -> Optional[str]:
    if qweight.format != "int4":
        return Planned(f"{qweight.format} weights (takes int4)")
    if x.dtype not in DTYPES:  # the loader's warning says so once (quant/report.py)
        return Planned(f"activation dtype {str(x.dtype).replace('torch.', '')} (takes bfloat16)")
    return declined_inputs(x, qweight, bias) or prepare(qweight).declined


def uint4_matmul(x, qweight, bias=None):
    """``linear_q`` on Habana's 4-bit dequantization: x [..., K] @ dequantize(qweight).T -> [..., N] (+ bias)."""
    n, k = qweight.shape
    packed = prepare(qweight)
    w = torch.ops.hpu.convert_from_uint4(packed.qweight, bf16_scales(packed, qweight), packed.zeros, x.dtype)
    x2 = x.reshape(-1, k)
    if packed.perm is not None:
        x2 = x2.index_select(1, packed.perm)
    y = torch.matmul(x2, w)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)
