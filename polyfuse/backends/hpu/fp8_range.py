"""fp8 weights within Gaudi2's range: e4m3 there holds up to 240, not 448.

Gaudi2's e4m3 (exponent bias 7) keeps its top exponent for inf / NaN, so float8_e4m3fn codes of 256..448 (exponent
field 15), which a weight quantized for NVIDIA's or Gaudi3's range (largest value 448) has, are not numbers there:
Intel Neural Compressor and optimum-habana quantize for 240 on Gaudi2 (``get_fullscale``, ``FP8_MAX``). polyfuse
quantizes for 448 everywhere and loads fp8 checkpoints as stored, so on Gaudi2 every weight row holding such a code is
halved and its scales doubled, once, after loading (``HpuRuntime.adapt_quantized``): the same weights, now within
the range. Halving is exact in e4m3 except below 2^-5, where the last bit of a subnormal rounds to nearest even (at
most 2^-10 of the row's scale, far below the format's resolution for that row's largest values).

It works on the codes as integers, on the device, because Gaudi2 cannot read the out-of-range codes as numbers.
"""

from __future__ import annotations

import torch

from polyfuse.ops.quant_formats import FP8


GAUDI2_FP8_MAX = 240.0
_TOP_EXPONENT = 15


def rows_out_of_range(codes: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows of an e4m3 weight [N, K] holding a code beyond 240 (exponent field 15)."""
    e = (codes.view(torch.uint8).to(torch.int32) >> 3) & 15
    return (e == _TOP_EXPONENT).any(dim=-1)


def halve_codes(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes -> the codes of half their values (exact for normals above 2^-5; round to nearest even below)."""
    b = codes.view(torch.uint8).to(torch.int32)
    sign, e, m = b & 0x80, (b >> 3) & 15, b & 7
    # below 2^-5 the value is k * 2^-9 with k = m (subnormal, e == 0) or 8 + m (e == 1); half of it is k / 2 * 2^-9:
    # rounded to nearest even it is again a subnormal, or 2^-6 (k / 2 rounds to 8: the smallest normal, code 8)
    k = torch.where(e == 0, m, m + 8)
    half = (k >> 1) + ((k & 1) & ((k >> 1) & 1))
    small = half  # codes 0..8: subnormal mantissas, and 8 is exponent 1, mantissa 0
    normal = ((e - 1) << 3) | m
    out = torch.where(e >= 2, normal, small) | sign
    return out.to(torch.uint8).view(FP8)


@torch.no_grad()
def fit_gaudi2(qweight: torch.Tensor, scales: torch.Tensor) -> int:
    """Halve, in place, the rows of an fp8 weight [N, K] that Gaudi2 cannot hold and double their scales (per
    channel [N] or per block [N, blocks]); returns how many rows changed."""
    rows = rows_out_of_range(qweight)
    count = int(rows.sum())
    if count:
        qweight[rows] = halve_codes(qweight[rows])
        view = scales.view(scales.shape[0], -1)
        view[rows] = view[rows] * 2
    return count
