"""Linear layer fused with cross-entropy: ``cross_entropy(hidden @ weight.T, labels)`` without keeping the logits.

hidden [N, H], weight [V, H], labels [N] (``ignore_index`` entries do not count), reduction "mean" or "sum".
The native reference materializes the logits in fp32; fused implementations work in chunks of rows.
"""

import torch
import torch.nn.functional as F

from polyfuse.core.registry import OpSpec, declare


def linear_cross_entropy_native(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    logits = hidden @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)


SPEC = declare(
    OpSpec(
        "linear_cross_entropy",
        "linear_cross_entropy(hidden[N,H], weight[V,H], labels[N], ignore_index=-100, reduction='mean') -> loss",
        linear_cross_entropy_native,
    )
)
