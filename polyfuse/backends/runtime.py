"""Per-device runtime services the generation loop and trainer need besides ops: sync, memory, step boundaries, graphs.

``get_runtime(device)`` returns the runtime for a device type. The CPU runtime is the do-nothing default; the CUDA
and HPU backends subclass it in their own folders.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch


class DeviceRuntime:
    device_type = "cpu"
    # Which graph flag this device honours ("--use_cuda_graphs" / "--use_hpu_graphs"), None if neither.
    graph_flag: Optional[str] = None
    # Greedy decoding runs generation.TokenStep (the whole token, in place on persistent buffers) through
    # graph_module(..., "token", ...); False keeps the per-token loop (argmax and bookkeeping outside the step).
    inplace_decode = True

    def __init__(self, device: torch.device):
        self.device = device

    def synchronize(self) -> None:
        pass

    def mark_step(self) -> None:
        """Step boundary for lazy-mode devices (HPU). A no-op everywhere else."""

    def layer_hook(self) -> Optional[Callable[[], None]]:
        """Called by the model between decoder layers during inference, or None (no call at all)."""
        return None

    def graph_module(self, module: torch.nn.Module, phase: str, flags: dict):
        """Return a callable that runs ``module`` through the device's graphs when the run's flags ask for them; the
        base runtime runs it as is. ``phase``: "prefill" or "decode" (a whole cached step returning logits), or
        "token" (asked only where ``inplace_decode``: a whole greedy token that updates its tensor arguments in
        place and returns nothing)."""
        return module

    def reset_peak_memory(self) -> None:
        pass

    def memory_stats(self) -> dict:
        """GB, keyed like optimum-habana's get_hpu_memory_stats(). On the CPU: the process's resident memory."""
        gb = 1024**3
        stats = {}
        try:
            import resource

            with open("/proc/self/statm") as f:
                stats["memory_allocated (GB)"] = round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / gb, 2)
            stats["max_memory_allocated (GB)"] = round(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gb, 2
            )
            stats["total_memory_available (GB)"] = round(
                os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / gb, 2
            )
        except (OSError, ValueError, ImportError):  # not Linux
            pass
        return stats


_RUNTIMES: dict[str, type] = {"cpu": DeviceRuntime}


def register_runtime(device_type: str, cls: type) -> None:
    _RUNTIMES[device_type] = cls


def get_runtime(device) -> DeviceRuntime:
    from polyfuse.backends import registry

    registry._load_backends()
    device = torch.device(device)
    return _RUNTIMES.get(device.type, DeviceRuntime)(device)
