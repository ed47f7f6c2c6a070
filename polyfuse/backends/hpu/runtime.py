"""``HpuRuntime``: step boundaries, HPU graphs, sync and memory statistics on Gaudi.

* Lazy mode (``PT_HPU_LAZY_MODE`` unset or != "0", the Habana default) accumulates ops into a graph that runs at
  ``mark_step()``. The generation loop calls ``runtime.mark_step()`` after every step, and the model calls the hook
  from ``layer_hook()`` before every decoder layer in inference, as optimum-habana's ``GaudiLlamaModel`` does.
  With ``PT_HPU_LAZY_MODE=0`` (eager / torch.compile) mark_step is never called.
* ``graph_module`` wraps a step module with ``habana_frameworks.torch.hpu.wrap_in_hpu_graph`` under
  ``--use_hpu_graphs``. That call replaces ``module.forward`` in place (and gives the wrapper a
  ``bypass_hpu_graphs=True`` keyword that runs the plain forward), so a module is wrapped once whatever phase asks
  first, and each phase gets an :class:`HpuGraphStep` around it. With ``--limit_hpu_graphs`` the prefill step passes
  ``bypass_hpu_graphs=True``: exactly optimum-habana's first-token bypass; no graph is captured for the prompt.
  ``step.reset()`` drops the captured graphs (``module.clear_cache()``), needed when the KV cache is reallocated:
  graphs hold the tensors they were captured with.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import torch

from polyfuse.backends.hpu import _habana
from polyfuse.backends.runtime import DeviceRuntime


logger = logging.getLogger("polyfuse")

_WRAPPED = "_polyfuse_hpu_graph"


def lazy_mode_enabled() -> bool:
    return os.environ.get("PT_HPU_LAZY_MODE", "1") != "0"


class HpuGraphStep:
    """What ``graph_module`` returns under --use_hpu_graphs: calls the module wrapped by ``wrap_in_hpu_graph``."""

    def __init__(self, module: torch.nn.Module, bypass: bool = False):
        self.module = module
        self.bypass = bypass  # --limit_hpu_graphs on the prefill step: run the plain forward

    def __call__(self, *args, **kwargs):
        if self.bypass:
            kwargs["bypass_hpu_graphs"] = True
        return self.module(*args, **kwargs)

    def reset(self) -> None:
        """Drop every captured graph of the wrapped module (shared by the prefill and decode steps)."""
        clear = getattr(self.module, "clear_cache", None)
        if clear is not None:
            clear()


class HpuRuntime(DeviceRuntime):
    device_type = "hpu"
    graph_flag = "use_hpu_graphs"
    # Whether HPU graphs replay in-place updates of their inputs faithfully is unverified: keep the per-token loop.
    inplace_decode = False

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.lazy_mode = lazy_mode_enabled()

    # -- step boundaries -------------------------------------------------------------------------------------------
    def _mark_step_fn(self) -> Optional[Callable[[], None]]:
        if not self.lazy_mode:
            return None
        return _habana.import_component(_habana.CORE, "mark_step")

    def mark_step(self) -> None:
        fn = self._mark_step_fn()
        if fn is not None:
            fn()

    def layer_hook(self) -> Optional[Callable[[], None]]:
        return self._mark_step_fn()

    # -- graphs ----------------------------------------------------------------------------------------------------
    def graph_module(self, module: torch.nn.Module, phase: str, flags: dict):
        if phase not in ("prefill", "decode"):
            raise ValueError(f"graph_module: phase must be 'prefill' or 'decode', got {phase!r}")
        if not flags.get("use_hpu_graphs"):
            return module
        if flags.get("torch_compile"):
            logger.warning("polyfuse: --use_hpu_graphs is ignored with --torch_compile (as in optimum-habana)")
            return module
        if not self.lazy_mode:
            raise ValueError("--use_hpu_graphs needs lazy mode (PT_HPU_LAZY_MODE=1) or --torch_compile")
        wrap = _habana.require(_habana.HPU, "wrap_in_hpu_graph")
        if not getattr(module, _WRAPPED, False):
            kwargs = {}
            if flags.get("max_graphs") is not None:
                kwargs["max_graphs"] = flags["max_graphs"]
            module = wrap(module, **kwargs)
            setattr(module, _WRAPPED, True)
        return HpuGraphStep(module, bypass=phase == "prefill" and bool(flags.get("limit_hpu_graphs")))

    # -- sync and memory -------------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        sync = _habana.import_component(_habana.HPU, "synchronize")
        if sync is None:
            sync = getattr(getattr(torch, "hpu", None), "synchronize", None)
        if sync is not None:
            sync()

    def reset_peak_memory(self) -> None:
        reset = _habana.import_component(_habana.HPU, "reset_peak_memory_stats")
        if reset is not None:
            reset()

    def memory_stats(self) -> dict:
        """Like optimum-habana's ``get_hpu_memory_stats``: InUse / MaxInUse / Limit in GB, rounded to 2 decimals."""
        stats_fn = _habana.import_component(_habana.HPU, "memory_stats")
        if stats_fn is None:
            return super().memory_stats()
        mem = stats_fn(self.device)
        gb = 1024**3
        return {
            "memory_allocated (GB)": round(mem["InUse"] / gb, 2),
            "max_memory_allocated (GB)": round(mem["MaxInUse"] / gb, 2),
            "total_memory_available (GB)": round(mem["Limit"] / gb, 2),
        }
