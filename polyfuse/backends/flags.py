"""Which run flags a device honours. A flag the device cannot honour is turned off with one warning that names
the fallback; nothing is silently ignored and nothing raises for it."""

from __future__ import annotations


# flag -> (device type that honours it, what runs instead elsewhere)
DEVICE_FLAGS = {
    "use_hpu_graphs": ("hpu", "no HPU graphs (on NVIDIA use --use_cuda_graphs)"),
    "limit_hpu_graphs": ("hpu", "ignored"),
    "use_cuda_graphs": ("cuda", "eager steps, no CUDA graphs"),
    "flash_attention_recompute": ("hpu", "ignored (Gaudi FusedSDPA option)"),
    "flash_attention_causal_mask": ("hpu", "ignored (Gaudi FusedSDPA option); the attention mask is used"),
    "flash_attention_fast_softmax": ("hpu", "ignored (Gaudi FusedSDPA option)"),
    "attn_softmax_bf16": ("hpu", "ignored; softmax stays in fp32"),
}


def check_flags(device_type: str, flags: dict) -> tuple[dict, list[str]]:
    """Return (flags the run will use, one warning line per flag turned off)."""
    flags = dict(flags)
    warnings = []
    for name, (needs, fallback) in DEVICE_FLAGS.items():
        if flags.get(name) and device_type != needs:
            warnings.append(f"--{name} needs device {needs}, this run is on {device_type}: {fallback}")
            flags[name] = False
    if flags.get("limit_hpu_graphs") and not flags.get("use_hpu_graphs"):
        warnings.append("--limit_hpu_graphs without --use_hpu_graphs: ignored")
        flags["limit_hpu_graphs"] = False
    if flags.get("use_hpu_graphs") and flags.get("torch_compile"):
        warnings.append("--use_hpu_graphs with --torch_compile: HPU graphs turned off, as in optimum-habana")
        flags["use_hpu_graphs"] = False
    return flags, warnings
