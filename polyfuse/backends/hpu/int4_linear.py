"""int4 projections on Gaudi: Habana's 4-bit dequantization, then one matmul, as Intel Neural Compressor's
``HPUWeightOnlyLinear`` and AutoGPTQ's HPU ``QuantLinear`` (optimum-habana's ``--load_quantized_model_with_autogptq``)
run a GPTQ checkpoint on Gaudi:

    w = torch.ops.hpu.convert_from_uint4(qweight_hpu, scales, zeros, x.dtype)     # [K, N]
    y = x @ w  (+ bias)

Habana packs eight weights of one input row k along N: ``qweight_hpu`` int32 [K, N / 8], weight (k, n) in bits
4 (n % 8) .. of word [k, n // 8]; AutoGPTQ's layout, which the module keeps (polyfuse/ops/quant_formats.py), packs
eight rows of K per word, [K / 8, N]. The same number of words: the repacked copy is made once per weight, by
``HpuRuntime.adapt_quantized`` after loading (or on the weight's first call), and kept beside the buffers, so on
Gaudi an int4 model holds its packed weights twice (a quarter of bf16 each: half of bf16 in all). It is remade when
the buffer is replaced or changed in place (another tensor, or its version counter moved). Per call, zeros go in
unpacked, [G, N] in the scales' dtype (AutoGPTQ's stored minus one undone; the bridge takes an unpacked zero point of
the scale's dtype) and the scales cast to the activations' dtype: bfloat16 scales, as INC stores them (AutoGPTQ's are
float16: a bfloat16 run rounds each to 8 significant bits, at most 2^-9 of it; float32 runs keep them exactly).

The bridge's 4-argument op (Synapse up to 1.22; the group index came later) broadcasts a [G, N] scale over blocks of
K / G consecutive rows, so:

* act-order checkpoints (g_idx a permutation's groups) run with their rows sorted by group once at repacking and the
  activations' columns gathered in that order per call (``x[..., perm]``): the same sum, reordered;
* a last partial group (K not a multiple of the group size) cannot be expressed: declined to the next choice (the
  native reference), as are float16 activations (INC and the bridge's grouped path use bfloat16), groups of uneven
  size and calls that need gradients.

Written against the bridge's schema and INC's / AutoGPTQ's calls; exercised by the test double (tests/habana_double),
never run on a Gaudi.
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


@dataclass
class HpuInt4:
    """One int4 weight in Habana's layout, or why it has none."""

    key: tuple  # the buffers it was made from: (id, _version) of qweight and g_idx
    g_idx: Optional[torch.Tensor]  # held, so that no other tensor takes its id while this entry lives
    qweight: Optional[torch.Tensor] = None  # int32 [K, N / 8]
    perm: Optional[torch.Tensor] = None  # act-order: the input columns in group order (None: in order already)
    declined: Optional[str] = None


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
    """int32 [K, N] of 4-bit values -> Habana's int32 [K, N / 8]: value j of each run of 8 along N in bits 4 j.."""
    k, n = q.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return (q.view(k, n // 8, 8).to(torch.int32) << shifts).sum(-1, dtype=torch.int32)


def _key(qw: QuantizedWeight) -> tuple:
    """Identity and version counter of qweight and g_idx: a buffer replaced (``module.to``, a new load) is another
    object, one changed in place (``copy_``) has moved its counter. No ``data_ptr()``: on a lazy HPU tensor that may
    materialize it, and this runs on every call."""
    return tuple((id(t), t._version) if t is not None else None for t in (qw.qweight, qw.g_idx))


def _current(got: Optional[HpuInt4], qw: QuantizedWeight) -> bool:
    return got is not None and got.g_idx is qw.g_idx and got.key == _key(qw)


def _make(qw: QuantizedWeight) -> HpuInt4:
    n, k = qw.shape
    key, groups = _key(qw), qw.scales.shape[0]
    if groups * qw.group_size != k:  # the op's blocks are K / G rows: only whole groups of group_size match them
        why = f"a last partial group (in_features {k}, groups of {qw.group_size}): Habana's {OP} takes whole groups"
        return HpuInt4(key, qw.g_idx, declined=why)
    q, _ = unpack_int4(qw)  # [K, N], the rows in the checkpoint's order
    perm = None
    if qw.g_idx is not None:
        g = qw.g_idx.long()
        order = torch.arange(k, device=g.device) // qw.group_size
        if not torch.equal(g, order):
            if not torch.equal(torch.bincount(g, minlength=groups), torch.full_like(order[:groups], qw.group_size)):
                return HpuInt4(key, qw.g_idx, declined="act-order groups of uneven size")
            perm = torch.argsort(g, stable=True)
            q = q[perm]
    return HpuInt4(key, qw.g_idx, pack_rows(q), perm)


def prepare(qw: QuantizedWeight) -> HpuInt4:
    """Habana's layout of ``qw``, made once and remade when its buffers change."""
    got = _PACKED.get(qw.qweight)
    if not _current(got, qw):
        got = _PACKED[qw.qweight] = _make(qw)
    return got


def accepts_linear_q(x, qweight, bias=None) -> Optional[str]:
    if qweight.format != "int4":
        return Planned(f"{qweight.format} weights (takes int4)")
    return declined_inputs(x, qweight, bias) or prepare(qweight).declined


def zeros_and_scales(qw: QuantizedWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(zeros, scales), both [G, N] in ``dtype``: the zero points unpacked with AutoGPTQ's minus one undone."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qw.qzeros.device)
    zeros = ((qw.qzeros[..., None] >> shifts) & 15).flatten(-2) + 1
    return zeros.to(dtype), qw.scales.to(dtype)


def uint4_matmul(x, qweight, bias=None):
    """``linear_q`` on Habana's 4-bit dequantization: x [..., K] @ dequantize(qweight).T -> [..., N] (+ bias)."""
    n, k = qweight.shape
    packed = prepare(qweight)
    zeros, scales = zeros_and_scales(qweight, x.dtype)
    w = torch.ops.hpu.convert_from_uint4(packed.qweight, scales, zeros, x.dtype)  # [K, N]
    x2 = x.reshape(-1, k)
    if packed.perm is not None:
        x2 = x2.index_select(1, packed.perm)
    y = torch.matmul(x2, w)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)
