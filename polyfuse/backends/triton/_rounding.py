"""Shared Triton helper: float32 -> storage dtype with round-to-nearest-even everywhere.

On GPUs ``x.to(tl.bfloat16)`` already rounds to nearest even. Triton's CPU interpreter truncates instead, which
would make the interpreter tests measure a rounding the GPU never does; under ``TRITON_INTERPRET=1`` the bf16 case
is rounded by hand (bit arithmetic on the fp32 pattern), so both paths give the same bits.
"""

import torch
import triton
import triton.language as tl

from polyfuse.core import settings


# Triton picks interpreter or compiler once, at its import; the jit-ed helpers need the answer as a constexpr.
INTERPRET = settings.get("TRITON_INTERPRET")
# Inline PTX (the quantized GEMVs' byte permutes) compiles on NVIDIA GPUs only: not under the interpreter (which
# takes the Triton-arithmetic branch) and not on ROCm, where the Triton backend also runs.
PTX = not INTERPRET and getattr(torch.version, "hip", None) is None
_EMULATE_RNE = tl.constexpr(INTERPRET)


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    if _EMULATE_RNE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)
