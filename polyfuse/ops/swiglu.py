"""SwiGLU gate: ``silu(gate) * up``. gate and up may be strided views of one fused gate/up projection."""

import torch
import torch.nn.functional as F

from polyfuse.core.registry import OpSpec, declare


def swiglu_native(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


SPEC = declare(OpSpec("swiglu", "swiglu(gate[..., I], up[..., I]) -> silu(gate) * up", swiglu_native))
