"""Right-padded (or otherwise gapped) prompt batches made left-padded before generation.

The loop appends each new token after the last column of the batch, so every row's prompt must end there: a
right-padded row would continue from its pads (transformers warns "right-padding was detected" and generates from
them anyway). Here each row's real tokens are moved, in order, to the end of the row and its pads to the front, which
is the batch the tokenizer gives with ``padding_side="left"``; generation then returns exactly what that batch gives,
in its layout (prompt columns left-padded, then the new tokens).
"""

from __future__ import annotations

import torch


def to_left_padding(input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, mask) with every row's unmasked tokens at its end, or the inputs themselves when they already are
    (one check: no real token after a pad in any row)."""
    if input_ids.shape[1] < 2 or not bool((mask[:, 1:] < mask[:, :-1]).any()):
        return input_ids, mask
    order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)  # pads (0) first, each group in its own order
    return input_ids.gather(1, order), mask.gather(1, order)
