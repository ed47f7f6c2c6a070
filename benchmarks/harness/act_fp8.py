"""What fp8's W8A8 GEMMs compute, emulated on every row: the perplexity tool's ``fp8+w8a8`` / ``fp8_block+w8a8``
(benchmarks/evaluate_perplexity.py), so the CPU scores what a GPU's fp8 prefill and scoring windows compute.

On an NVIDIA GPU with fp8 tensor cores a per-channel ``fp8`` projection of more than 64 rows (the prompt, a scoring
window) quantizes its activations to e4m3 per token and multiplies on the fp8 tensor cores (triton:fp8_scaled_mm,
cuda:scaled_mm: K and N multiples of 16, bfloat16); ``fp8_block`` from two rows on per token and 128 columns
(triton:fp8_block_mm: K a multiple of 128, sm90). The CPU has no such path: there fp8 is weight-only. Here the
projections those kernels take see their activations rounded as the kernels round them (ops/quant_linear.py
``fp8_activations``) and multiply in float32; the product then differs from the GPU's only by the summation order
and the output's rounding. One-row decode and 2..64 rows of per-channel fp8 stay weight-only on the GPU too (the
GEMV, the dequantizing GEMM): this is the prefill's arithmetic, not decode's.
"""

from __future__ import annotations

from benchmarks.harness.act_emulation import round_projection_inputs_
from polyfuse.ops.quant_formats import FP8_BLOCK
from polyfuse.ops.quant_linear import fp8_activations


# the evaluate_perplexity.py --quant formats a GPU multiplies on e4m3 activations (+w8a8)
FORMATS = ("fp8", "fp8_block")


def takes_w8a8(qweight) -> bool:
    """Whether a GPU's W8A8 GEMM takes this packed weight: per-channel fp8 with K and N multiples of 16
    (ops/quant_linear.py ``scaled_mm_refusal``), fp8_block with K a multiple of 128 and N of 16."""
    n, k = qweight.shape
    if qweight.format == "fp8":
        return k % 16 == 0 and n % 16 == 0
    return qweight.format == "fp8_block" and k % FP8_BLOCK == 0 and n % 16 == 0


def w8a8_activations(qweight):
    """The rounding a GPU's W8A8 GEMM applies to this weight's activations (per token for fp8, per token and 128
    columns for fp8_block), or None where that GEMM does not take the weight (``takes_w8a8``)."""
    if not takes_w8a8(qweight):
        return None
    group = FP8_BLOCK if qweight.format == "fp8_block" else 0
    return lambda x: fp8_activations(x, group)


def emulate_fp8_activations_(model) -> None:
    """Rebind ``model.kernels``' quantized-projection ops (in place) so that every projection a GPU multiplies on
    e4m3 activations (``takes_w8a8``) sees them rounded as that GEMM rounds them, on every row."""
    round_projection_inputs_(model.kernels, w8a8_activations)
