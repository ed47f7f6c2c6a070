"""Rounded activations emulated on every row: a run's ``Kernels`` rebound so that the projections whose packed
weight a kernel takes on rounded activations see those activations, and the model's own kernels do the rest. The
perplexity tool (benchmarks/evaluate_perplexity.py ``+a8``, ``+w8a8``) scores what those kernels compute this way,
teacher-forced, on every position: int8 activations in blocks of 32 (benchmarks/harness/act_int8.py: the one-row W4A8 / GGUF
GEMVs) and e4m3 activations per token (benchmarks/harness/act_fp8.py: fp8's W8A8 prefill GEMMs)."""

from __future__ import annotations


def round_projection_inputs_(kernels, rounding_for) -> None:
    """Rebind ``kernels``' quantized-projection ops (in place): a projection for whose packed weight
    ``rounding_for(qweight)`` gives a function multiplies that function of x (float32 values) in float32 and rounds
    the product once to x's dtype, as the kernels emulated do; where it gives None, and for the SwiGLU and norms
    before a projection, the run's own kernels run."""
    linear_q, swiglu, add_rms_norm, rms_norm = kernels.linear_q, kernels.swiglu, kernels.add_rms_norm, kernels.rms_norm

    def rounded_linear_q(x, qweight, bias=None):
        rounding = rounding_for(qweight)
        if rounding is None:
            return linear_q(x, qweight, bias)
        out = linear_q(rounding(x), qweight, None if bias is None else bias.float())
        return out.to(x.dtype)

    def rounded_swiglu_linear_q(gate, up, qweight, bias=None):
        return rounded_linear_q(swiglu(gate, up), qweight, bias)

    def rounded_add_rms_norm_linear_q(x, residual, weight, eps, qweight, bias=None):
        y, r = (rms_norm(x, weight, eps), x) if residual is None else add_rms_norm(x, residual, weight, eps)
        return rounded_linear_q(y, qweight, bias), r

    kernels.linear_q = rounded_linear_q
    kernels.swiglu_linear_q = rounded_swiglu_linear_q
    kernels.add_rms_norm_linear_q = rounded_add_rms_norm_linear_q
