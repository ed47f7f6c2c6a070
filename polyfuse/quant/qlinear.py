"""The modules that hold packed weights: :class:`QLinear` (one projection's packed buffers, no dense weight) and
:class:`QLinearStack` (a fused projection whose parts are packed in different formats). The loader and the in-memory
quantizers that fill them are in quant/quantize.py; the formats' buffers in polyfuse/ops/quant_formats.py; the
decoder sends them to the ``linear_q`` ops (models/decoder.py ``project``)."""

from __future__ import annotations

import torch
from torch import nn

from polyfuse.ops.quant_formats import FP8_BLOCK, INT4_GROUP, QuantizedWeight, components


class QLinear(nn.Module):
    """A projection holding a packed weight (buffers named as in polyfuse/ops/quant_formats.py) and its bias.

    ``parts`` are the output rows of the checkpoint tensors fused into it (q/k/v, gate/up), in order."""

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool, dtype: torch.dtype,
                 group_size: int = INT4_GROUP, parts: tuple = ()):  # fmt: skip
        super().__init__()
        self.in_features, self.out_features, self.format = in_features, out_features, fmt
        self.group_size = {"int4": group_size, "fp8_block": FP8_BLOCK}.get(fmt, 0)
        self.parts = tuple(parts) or (out_features,)
        self.act_order = False
        self.spec = components(fmt, out_features, in_features, self.group_size or INT4_GROUP)
        for name, c in self.spec.items():
            self.register_buffer(name, torch.empty(c.shape, dtype=c.dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def quantized_weight(self) -> QuantizedWeight:
        b = self._buffers
        return QuantizedWeight(self.format, (self.out_features, self.in_features), b["qweight"], b.get("scales"),
                               b.get("qzeros"), b.get("g_idx"), self.group_size, self.act_order)  # fmt: skip

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}" + (
            f", group_size={self.group_size}" if self.group_size else ""
        )


class QLinearStack(nn.Module):
    """A fused projection whose checkpoint parts are packed in different formats (a Q4_K_M GGUF's q/k Q4_K with v
    Q6_K, or a polyfuse save of one): one QLinear per run of consecutive parts in one format (``segments``, each
    with its ``hf_parts``), projected one after the other and concatenated in row order (models/decoder.py
    ``project``), then the fused bias. Not an ``nn.Linear``: it has no dense weight."""

    def __init__(self, in_features: int, out_features: int, segments: list, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.segments = nn.ModuleList(segments)
        self.parts = tuple(s for q in segments for s in q.parts)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantized_modules(model) -> dict[str, QLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QLinear)}


def head_quantized(model) -> bool:
    return isinstance(model.get_output_embeddings(), QLinear)
