"""The device-runtime protocol: what the decoding engine and the trainer need from a device besides ops.

``get_runtime(device)`` returns the runtime registered for the device type (backends register theirs from their
plugin entry point); the CPU runtime is this do-nothing base class. A runtime also declares which device-specific
run flags it honours (``honours``: the rest are turned off with one warning, see ``polyfuse.core.flags``) and hands
out the device's fused optimizer pieces, so training code never imports a backend.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from polyfuse.core.plugins import load_plugins


class Step:
    """What ``graph_module`` returns: calls the step; ``reset()`` drops whatever graphs were captured for it (the
    engine calls it when the buffers a graph holds, the KV cache or the rotary tables, were reallocated)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def reset(self) -> None:
        pass


class DeviceRuntime:
    device_type = "cpu"
    # Device-specific run flags this runtime honours (graph flags, attention kernel options).
    honours: frozenset = frozenset()
    # Greedy decoding runs the engine's TokenStep (the whole token, in place on persistent buffers) through
    # graph_module(..., "token", ...); False keeps the per-token loop (argmax and bookkeeping outside the step).
    inplace_decode = True
    # Every new tensor shape costs a graph compilation (Gaudi): generation keeps shapes static where it can (the
    # cache-less forward over prompt + max_new_tokens positions).
    static_shapes = False
    # --torch_compile compiles the whole decoder (each layer with --regional_compile) as optimum-habana does on
    # Gaudi; False: the ops that run their native reference, unless --regional_compile / --force_static_compile ask
    # for the decoder's layers (polyfuse/loader/compile.py).
    compiles_decoder = False
    # Whether decoder layers compile with this device's backend (False where they launch kernels it cannot trace).
    compiles_layers = True

    def __init__(self, device: torch.device):
        self.device = device

    @classmethod
    def lazy_mode_enabled(cls) -> bool:
        """Whether this device type runs in lazy mode, ops gathered into graphs run at step boundaries (HPU: Habana's
        own answer); False for eager devices."""
        return False

    @classmethod
    def refusal(cls, flags: dict):
        """None, or one line saying why this device cannot run with these flags at all and what to set (checked
        before anything is loaded)."""
        return None

    def synchronize(self) -> None:
        pass

    def sampling_generator(self, seed: int) -> Optional[torch.Generator]:
        """The generator sampling draws from, seeded: one on the device; None where torch has no generator for the
        device and the device's default one was seeded instead (HPU), so no token's probabilities leave it."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def mark_step(self) -> None:
        """Step boundary for lazy-mode devices (HPU). A no-op everywhere else."""

    def layer_hook(self) -> Optional[Callable[[], None]]:
        """Called by the model between decoder layers during inference, or None (no call at all)."""
        return None

    def graph_module(self, module: torch.nn.Module, phase: str, flags: dict) -> Step:
        """A :class:`Step` that runs ``module`` through the device's graphs when the run's flags ask for them; the
        base runtime runs it as is. ``phase``: "prefill" or "decode" (a whole cached step returning logits), or
        "token" (asked only where ``inplace_decode``: a whole greedy token that updates its tensor arguments in
        place and returns nothing)."""
        return Step(module)

    def inference_graphs(self, module: torch.nn.Module, disable_tensor_cache: bool = False, max_graphs=None):
        """``module``, its forward run through the device's graphs for evaluation (the trainer's
        ``use_hpu_graphs_for_inference``); the base runtime returns it unchanged."""
        return module

    def training_graphs(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module``, its training forward and backward cached in the device's graphs (``use_hpu_graphs_for_training``);
        the base runtime returns it unchanged."""
        return module

    @classmethod
    def fp8_max(cls) -> Optional[float]:
        """The largest e4m3 value this device holds where it is less than float8_e4m3fn's 448 (Gaudi2: 240), else
        None. Weights quantized to fp8 on the device are scaled to it (quant/quantize.py)."""
        return None

    def adapt_quantized(self, weights, kernels=None) -> None:
        """Called after quantized weights are loaded or made (quant/quantize.py ``finalize``, which may run more
        than once on a model: a second call must change nothing) with the model's ``QuantizedWeight`` objects and
        its resolved kernels (None where it has none yet): a device whose kernels need another form of a format
        changes the buffers in place or prepares that form here (HPU: fp8 rows beyond Gaudi2's range; int4 repacked
        for Habana's kernel). The base runtime keeps them as they are."""

    def compile_backend(self) -> str:
        """The torch.compile backend for this device."""
        return "inductor"

    def compile_options(self, static: bool) -> Optional[dict]:
        """torch.compile's ``options`` for this device's backend (``static``: --force_static_compile), or None."""
        return None

    def fused_optimizer(self, params, **kwargs):
        """The device's fused AdamW over ``params`` (parameter groups), or None to let the trainer build its own."""
        return None

    def fused_clip_norm(self, params, max_norm: float):
        """An object with ``clip_norm(parameters) -> total norm`` clipping in place, or None (torch's clipping)."""
        return None

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


def runtime_class(device_type: str) -> type:
    load_plugins()
    return _RUNTIMES.get(device_type, DeviceRuntime)


def get_runtime(device) -> DeviceRuntime:
    device = torch.device(device)
    return runtime_class(device.type)(device)
