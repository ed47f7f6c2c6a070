"""CUDA runtime services: synchronize, memory statistics, and whole-step CUDA graphs for decoding."""

from __future__ import annotations

import torch

from polyfuse.backends.cuda.graphs import GraphedStep
from polyfuse.core.runtime import DeviceRuntime, Step


class CudaRuntime(DeviceRuntime):
    device_type = "cuda"
    honours = frozenset({"use_cuda_graphs"})

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def graph_module(self, module, phase: str, flags: dict) -> Step:
        # Prefill shapes follow the prompt, so only the per-token steps are captured; the greedy token step updates
        # its arguments in place, so they are the graph's own buffers.
        if phase in ("decode", "token") and flags.get("use_cuda_graphs"):
            return GraphedStep(module, inplace=phase == "token")
        return Step(module)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def memory_stats(self) -> dict:
        gb = 1024**3
        total = torch.cuda.get_device_properties(self.device).total_memory
        return {
            "memory_allocated (GB)": round(torch.cuda.memory_allocated(self.device) / gb, 2),
            "max_memory_allocated (GB)": round(torch.cuda.max_memory_allocated(self.device) / gb, 2),
            "total_memory_available (GB)": round(total / gb, 2),
        }
