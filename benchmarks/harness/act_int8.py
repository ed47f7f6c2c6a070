"""The quality of the kernel option ``int4_a8`` (and of the GGUF one-row GEMV's default, ``gguf_a8``) measured over
a whole text: a model whose int4 (GGUF: kept as stored) projections see their activations quantized to int8 in
blocks of 32 and back (polyfuse/ops/act_int8.py), on every row.

The W4A8 GEMV runs only one-row decode; scoring a text one token at a time through it is slow, so the perplexity tool
(benchmarks/evaluate_perplexity.py ``int4+a8``) emulates it instead: teacher-forced, every position's projections get
the activations that decode would quantize (where the W4A8 GEMV takes the weight), multiplied in float32 and rounded
once, and the model's own kernels do the rest. Differences from the decode kernels: SwiGLU is the run's own (the
W4A8 path rounds silu(gate) * up once, as the Triton SwiGLU kernel does), and the run's linear_q on float32
activations dequantizes the weight to float32 (the GEMV does too) but sums in its own order.
tests/test_int4_a8.py and tests/test_gguf_a8.py check the decode kernels against this emulation.
"""

from __future__ import annotations

from benchmarks.harness.act_emulation import round_projection_inputs_
from polyfuse.ops.act_int8 import dequantize_act_int8, quantize_act_int8, takes, takes_gguf


# the evaluate_perplexity.py --quant formats whose one-row GEMV has an int8-activation form (ops/act_int8.py
# ``takes``: int4; ``takes_gguf``: a GGUF's weights kept as stored)
FORMATS = ("int4", "gguf")


def int8_activations(x):
    """x with each block of 32 values quantized to int8 and back, in float32 (the W4A8 GEMV multiplies these
    exactly, without rounding them to x's dtype)."""
    q, d = quantize_act_int8(x)
    return dequantize_act_int8(q, d)


def emulate_int8_activations_(model) -> None:
    """Rebind ``model.kernels``' quantized-projection ops so that the projections the W4A8 GEMV takes see int8
    activations (in place); the product in float32, rounded once to the activations' dtype, as the GEMV's."""
    round_projection_inputs_(model.kernels, lambda qw: int8_activations if takes(qw) or takes_gguf(qw) else None)
