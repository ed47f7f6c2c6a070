"""Op declarations: one file per op, each with its signature and its native PyTorch reference."""

from polyfuse.ops import (
    add_rms_norm,
    all_reduce,
    attention,
    linear,
    linear_cross_entropy,
    lora_linear,
    norm_linear_q,
    paged_attention,
    qk_norm,
    quant_linear,
    rms_norm,
    rotary,
    rotary_kv_write,
    swiglu,
)
from polyfuse.ops.attention import AttentionMeta
from polyfuse.ops.paged_attention import PagedMeta


__all__ = [
    "AttentionMeta",
    "add_rms_norm",
    "all_reduce",
    "attention",
    "linear",
    "linear_cross_entropy",
    "lora_linear",
    "norm_linear_q",
    "paged_attention",
    "PagedMeta",
    "qk_norm",
    "quant_linear",
    "rms_norm",
    "rotary",
    "rotary_kv_write",
    "swiglu",
]
