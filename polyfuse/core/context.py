"""What a selection is made for: device and its platform, dtype, the run's flags (and the kernel options among them),
training or inference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from polyfuse.core.kernel_options import KernelOptions, from_flags
from polyfuse.core.platform import Platform, detect_platform


@dataclass
class SelectionContext:
    device: torch.device
    dtype: torch.dtype = torch.float32
    flags: dict = field(default_factory=dict)
    training: bool = False
    overrides: str = ""
    platform: Optional[Platform] = None  # detected from ``device`` when not given

    def __post_init__(self):
        if isinstance(self.device, (str, int)):
            self.device = torch.device(self.device)
        if self.platform is None:
            self.platform = detect_platform(self.device)

    def flag(self, name: str, default=False):
        return self.flags.get(name, default)

    @property
    def options(self) -> KernelOptions:
        """The run's kernel options (core/kernel_options.py), from its flags."""
        return from_flags(self.flags)
