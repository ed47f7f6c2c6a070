"""Platform identity: what a device really is, beyond ``device.type``.

A ROCm GPU is ``device.type == "cuda"`` in PyTorch; kernels and tables tuned on NVIDIA must not follow it there.
``detect_platform(device)`` names the platform (``cuda``, ``rocm``, ``hpu``, ``xpu``, ``cpu`` or the device type of
anything else) and, for GPUs, the device's product name and compute capability (for per-GPU tuned tables).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    name: str  # cuda | rocm | hpu | xpu | cpu | <device type>
    device_type: str
    device_name: str = ""  # e.g. "NVIDIA H200"; "" when unknown or not a GPU
    capability: tuple = ()


def _gpu_facts(device: torch.device) -> tuple[str, tuple]:
    try:
        if not torch.cuda.is_available():
            return "", ()
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))
    except (RuntimeError, AssertionError, AttributeError):
        return "", ()


@functools.lru_cache(maxsize=None)
def _detect(device_type: str, index) -> Platform:
    if device_type == "cuda":
        name, cap = _gpu_facts(torch.device(device_type, index) if index is not None else torch.device(device_type))
        return Platform("rocm" if getattr(torch.version, "hip", None) else "cuda", "cuda", name, cap)
    return Platform(device_type, device_type)


def detect_platform(device) -> Platform:
    if isinstance(device, (str, int)):
        device = torch.device(device)
    return _detect(device.type, getattr(device, "index", None))


@functools.lru_cache(maxsize=None)
def hpu_available() -> bool:
    """True inside Habana's stack with a Gaudi visible (imports ``habana_frameworks`` only when it is installed)."""
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    try:
        hthpu = importlib.import_module("habana_frameworks.torch.hpu")
        return bool(hthpu.is_available())
    except Exception:
        return False


def default_device_type() -> str:
    """hpu when a Gaudi is visible, else cuda when a GPU is, else cpu (the order optimum-habana users expect)."""
    if hpu_available():
        return "hpu"
    return "cuda" if torch.cuda.is_available() else "cpu"
