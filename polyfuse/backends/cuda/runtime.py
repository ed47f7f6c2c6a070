"""CUDA runtime services: synchronize, memory statistics, and whole-step CUDA graphs for decoding (and, with
``cuda_graph_prefill``, for the prompt step)."""

from __future__ import annotations

import torch

from polyfuse.backends.cuda.graphs import GraphedStep
from polyfuse.core.runtime import DeviceRuntime, Step


class CudaRuntime(DeviceRuntime):
    device_type = "cuda"
    honours = frozenset({"use_cuda_graphs", "cuda_graph_prefill"})
    # The layers launch Triton kernels, which inductor does not trace reliably (registry.Kernels.compiled): the
    # native ops compile on their own instead.
    compiles_layers = False

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def graph_module(self, module, phase: str, flags: dict) -> Step:
        # The greedy token step updates its arguments in place, so they are the graph's own buffers. The prompt
        # step's shapes follow the prompt: it is captured (once per batch x length) only when asked, which pays when
        # prompts share a length (--max_input_tokens pads them to one); as optimum-habana's HPU graphs do for it.
        if not flags.get("use_cuda_graphs"):
            return Step(module)
        if phase in ("decode", "token") or (phase == "prefill" and flags.get("cuda_graph_prefill")):
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
