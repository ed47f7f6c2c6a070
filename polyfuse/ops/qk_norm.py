"""Per-head RMSNorm of queries and keys before rotary (Qwen3): ``(rms_norm(q, q_weight), rms_norm(k, k_weight))``.

q [..., Hq, D] and k [..., Hkv, D] are normalized over their last dim with weights [D]. Where no backend fuses the
pair, the op is the run's own ``rms_norm`` choice applied to each (its composite definition).
"""

import torch

from polyfuse.core.registry import OpSpec, declare
from polyfuse.ops.rms_norm import rms_norm_native


def qk_norm_native(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float):
    return rms_norm_native(q, q_weight, eps), rms_norm_native(k, k_weight, eps)


def compose(kernels):
    def qk_norm(q, k, q_weight, k_weight, eps):
        return kernels.rms_norm(q, q_weight, eps), kernels.rms_norm(k, k_weight, eps)

    return qk_norm


SPEC = declare(
    OpSpec(
        "qk_norm",
        "qk_norm(q[..., Hq, D], k[..., Hkv, D], q_weight[D], k_weight[D], eps) -> (q_normed, k_normed)",
        qk_norm_native,
        compose=compose,
        composed_of=("rms_norm", "rms_norm"),
    )
)
