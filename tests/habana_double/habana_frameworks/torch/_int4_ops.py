"""TEST DOUBLE of ``torch.ops.hpu.convert_from_uint4``, the 4-bit dequantization Habana's bridge registers (the real
one is C++: ``hpu_ops/int4_ops.cpp``, TPC kernel ``dequantize_4_bit``). Not Habana software.

Schema as the bridge declares it up to Synapse 1.22 (INC: "the released docker 1.22.0 only supports 4 arguments"):

    hpu::convert_from_uint4(Tensor input, Tensor scale, Tensor? zero_point, ScalarType out_dtype) -> Tensor

Which bridge this models: the 4-argument schema (Synapse up to 1.22), with the argument checks of the bridge's later
source (hpu_ops/int4_ops.cpp with ``group_index``), the only one found that states them; the older source passes the
zero point straight to the ``dequantize_4_bit`` kernel. polyfuse uses the one form INC and AutoGPTQ's HPU module both
call (int32 packed zero points, bfloat16 scales and output), so only that form is relied on; the double's other
forms (unpacked zero points, float32 output) are what the later source accepts, not known to run on the old one.

What the bridge's code says, modelled here:

* ``input`` is int32 [..., C] reinterpreted as uint4 [..., 8 C]: value j of word c (low bits first) is column 8 c + j;
  other dtypes are refused ("Only int input tensors are supported").
* the output has the unpacked shape and ``out_dtype``; ``scale`` has the output's shape or differs in one dimension,
  which must divide the output's (``is_equal_except_one_and_divisible``): a [G, N] scale covers blocks of K / G
  consecutive rows of a [K, N] output. A last partial block cannot be expressed (K % G must be 0).
* ``zero_point`` is packed like ``input`` when its last dimension equals ``input``'s (then unpacked the same way), else
  an unpacked tensor; its dtype is ``input``'s (int32) or ``scale``'s. Its shape obeys the scale's rule.
* value = (q - zero_point) * scale, computed in float32 and rounded once to ``out_dtype`` (with a bf16 scale and a
  4-bit difference that is the correctly rounded product, as a bf16 multiply gives it).

Defined once per process, like the fp8 ops (_fp8_ops.py).
"""

import torch

from habana_frameworks.torch._fp8_ops import _check, record


SCHEMA = "convert_from_uint4(Tensor input, Tensor scale, Tensor? zero_point, ScalarType out_dtype) -> Tensor"


def _unpack(words: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words[..., None] >> shifts) & 15).flatten(-2)


def _broadcast(t: torch.Tensor, shape: tuple, op: str, what: str) -> torch.Tensor:
    """``t`` expanded to ``shape``: equal, or one dimension smaller that divides it (blocks of consecutive indices)."""
    if tuple(t.shape) == shape:
        return t
    diff = [i for i, (a, b) in enumerate(zip(shape, t.shape)) if a != b]
    ok = t.dim() == len(shape) and len(diff) == 1 and shape[diff[0]] % t.shape[diff[0]] == 0
    _check(ok, op, f"{what} shape {tuple(t.shape)} must match the output shape {shape} or differ in one dimension "
                   "that divides it")  # fmt: skip
    d = diff[0]
    return t.repeat_interleave(shape[d] // t.shape[d], dim=d)


def convert_from_uint4(input, scale, zero_point, out_dtype):
    op = "convert_from_uint4"
    record(op, input, scale, zero_point, out_dtype)
    _check(input.dtype == torch.int32, op, f"Only int input tensors are supported, got {input.dtype}")
    _check(1 <= input.dim() <= 4, op, f"input must have 1 to 4 dimensions, got {input.dim()}")
    q = _unpack(input)
    shape = tuple(q.shape)
    s = _broadcast(scale, shape, op, "scale").float()
    if zero_point is None:
        z = torch.zeros((), dtype=torch.float32)
    else:
        _check(zero_point.dtype in (input.dtype, scale.dtype), op,
               f"zero_point dtype {zero_point.dtype} must match the input's ({input.dtype}) or the scale's "
               f"({scale.dtype})")  # fmt: skip
        packed = zero_point.shape[-1] == input.shape[-1]
        zp = _unpack(zero_point) if packed else zero_point
        z = _broadcast(zp, shape, op, "zero_point").float()
    return ((q.float() - z) * s).to(out_dtype)


def _define():
    lib = torch.library.Library("hpu", "FRAGMENT")
    try:
        torch.ops.hpu.convert_from_uint4
        return lib  # defined by an earlier import of the double in this process
    except (AttributeError, RuntimeError):
        pass
    lib.define(SCHEMA)
    lib.impl("convert_from_uint4", convert_from_uint4, "CompositeExplicitAutograd")
    return lib


_LIB = _define()
