"""fp8 weights within Gaudi2's range: e4m3 there holds up to 240, not 448.

Gaudi2's e4m3 (exponent bias 7) keeps its top exponent for inf / NaN, so float8_e4m3fn codes of 256..448 (exponent
field 15), which a weight quantized for NVIDIA's or Gaudi3's range (largest value 448) has, are not numbers there:
Intel Neural Compressor and optimum-habana quantize for 240 on Gaudi2 (``get_fullscale``, ``FP8_MAX``), and so does
polyfuse for weights it quantizes on a Gaudi2 (``HpuRuntime.fp8_max``). fp8 checkpoints load as stored, though, and
those made for 448 (NVIDIA's, Gaudi3's, a polyfuse save from another device) hold such codes: on Gaudi2 every row
holding one is halved and its scales doubled after loading (``HpuRuntime.adapt_quantized``, after every ``finalize``; a
fitted row is not touched again): the same weights, now within the range. Halving is exact in e4m3 except below 2^-5,
where the last bit of a subnormal rounds to nearest even (at most 2^-9 of the row's original scale, far below the
format's resolution for that row's largest values).

It works on the codes as integers, on the device, because Gaudi2 cannot read the out-of-range codes as numbers.
"""

from __future__ import annotations

from typing import Optional

import torch

from polyfuse.backends.hpu import _habana
from polyfuse.ops.quant_formats import FP8


GAUDI2_FP8_MAX = 240.0
_TOP_EXPONENT = 15
CHUNK = 1 << 24  # codes per pass: the int16 temporaries of a 70B projection stay a few hundred MB


def device_fp8_max() -> Optional[float]:
    """e4m3's largest value on this Gaudi where it is below float8_e4m3fn's 448: 240 on Gaudi2, else None."""
    return GAUDI2_FP8_MAX if _habana.generation() == "gaudi2" else None


def rows_out_of_range(codes: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows of an e4m3 weight [N, K] holding a code beyond 240 (exponent field 15)."""
    step = max(1, CHUNK // max(codes.shape[-1], 1))
    parts = [((c.view(torch.uint8) >> 3) & 15 == _TOP_EXPONENT).any(dim=-1) for c in codes.split(step)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool, device=codes.device)


def halve_codes(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes -> the codes of half their values (exact for normals above 2^-5; round to nearest even below)."""
    b = codes.view(torch.uint8).to(torch.int16)
    sign, e, m = b & 0x80, (b >> 3) & 15, b & 7
    # below 2^-5 the value is k * 2^-9 with k = m (subnormal, e == 0) or 8 + m (e == 1); half of it is k / 2 * 2^-9:
    # rounded to nearest even it is again a subnormal, or 2^-6 (k / 2 rounds to 8: the smallest normal, code 8)
    k = torch.where(e == 0, m, m + 8)
    small = (k >> 1) + ((k & 1) & ((k >> 1) & 1))  # codes 0..8: subnormal mantissas, and 8 is exponent 1, mantissa 0
    normal = ((e - 1) << 3) | m
    return (torch.where(e >= 2, normal, small) | sign).to(torch.uint8).view(FP8)


@torch.no_grad()
def fit_gaudi2(qweight: torch.Tensor, scales: torch.Tensor) -> int:
    """Halve, in place, the rows of an fp8 weight [N, K] that Gaudi2 cannot hold and double their scales (per
    channel [N] or per block [N, blocks]); returns how many rows changed. A row within range is left as it is, so a
    second call changes nothing."""
    rows = rows_out_of_range(qweight)
    count = int(rows.sum())
    if count:
        step = max(1, CHUNK // max(qweight.shape[-1], 1))
        codes = qweight.view(torch.uint8)  # indexed as bytes: torch before 2.8 cannot index fp8 tensors on the CPU
        for r0 in range(0, qweight.shape[0], step):
            hot = rows[r0 : r0 + step]
            if bool(hot.any()):
                block = codes[r0 : r0 + step]
                block[hot] = halve_codes(block[hot]).view(torch.uint8)
        view = scales.view(scales.shape[0], -1)
        view[rows] = view[rows] * 2
    return count
