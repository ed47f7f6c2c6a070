"""Device-specific run flags and what runs where a device does not honour one. Each runtime declares the flags it
honours (``DeviceRuntime.honours``); a flag the run's device does not honour is turned off with one warning that
names the fallback; nothing is silently ignored and nothing raises for it."""

from __future__ import annotations

from polyfuse.core.runtime import runtime_class


# flag -> what runs instead on a device whose runtime does not honour it
DEVICE_FLAGS = {
    "use_hpu_graphs": "no HPU graphs (on NVIDIA use --use_cuda_graphs)",
    "limit_hpu_graphs": "ignored",
    "use_cuda_graphs": "eager steps, no CUDA graphs",
    "cuda_graph_prefill": "ignored (on Gaudi --use_hpu_graphs graphs the prompt step unless --limit_hpu_graphs)",
    "flash_attention_recompute": "ignored (Gaudi FusedSDPA option)",
    "flash_attention_causal_mask": "ignored (Gaudi FusedSDPA option); the attention mask is used",
    "flash_attention_fast_softmax": "ignored (Gaudi FusedSDPA option)",
    "attn_softmax_bf16": "ignored; softmax stays in fp32",
}


def honouring_devices(flag: str) -> str:
    from polyfuse.core.runtime import _RUNTIMES

    names = sorted(t for t, cls in _RUNTIMES.items() if flag in cls.honours)
    return "/".join(names) or "none"


def check_flags(device_type: str, flags: dict) -> tuple[dict, list[str]]:
    """Return (flags the run will use, one warning line per flag turned off); ValueError (one line saying what to
    set) for a combination the device's runtime cannot run at all (HPU graphs in Habana's eager mode)."""
    flags = dict(flags)
    runtime = runtime_class(device_type)
    honours = runtime.honours
    warnings = []
    for name, fallback in DEVICE_FLAGS.items():
        if flags.get(name) and name not in honours:
            warnings.append(
                f"--{name} needs device {honouring_devices(name)}, this run is on {device_type}: {fallback}"
            )
            flags[name] = False
    if flags.get("limit_hpu_graphs") and not flags.get("use_hpu_graphs"):
        warnings.append("--limit_hpu_graphs without --use_hpu_graphs: ignored")
        flags["limit_hpu_graphs"] = False
    if flags.get("cuda_graph_prefill") and not flags.get("use_cuda_graphs"):
        warnings.append("--cuda_graph_prefill without --use_cuda_graphs: ignored")
        flags["cuda_graph_prefill"] = False
    if flags.get("use_hpu_graphs") and flags.get("torch_compile"):
        warnings.append("--use_hpu_graphs with --torch_compile: HPU graphs turned off, as in optimum-habana")
        flags["use_hpu_graphs"] = False
    refusal = runtime.refusal(flags)
    if refusal is not None:
        raise ValueError(refusal)
    return flags, warnings
