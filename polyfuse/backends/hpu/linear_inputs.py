"""What every Habana ``linear_q`` kernel (fp8_linear.py, int4_linear.py) declines whatever the weight's format:
activations other than bfloat16 / float32 (the dtypes INC runs these ops in), a K that is not the weight's, and
calls that need gradients (the kernels are inference-only)."""

from __future__ import annotations

from typing import Optional

import torch


DTYPES = (torch.bfloat16, torch.float32)


def declined_inputs(x, qweight, bias=None) -> Optional[str]:
    if x.dtype not in DTYPES:
        return f"activation dtype {str(x.dtype).replace('torch.', '')} unsupported (bfloat16 or float32)"
    if x.shape[-1] != qweight.shape[1]:
        return "K mismatch"
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return "needs gradients"
    return None
