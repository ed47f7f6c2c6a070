"""The ground floor: the op registry, the selection context and platform identity, the device-runtime protocol,
the run flags and the plugin loader. Imports nothing else of polyfuse; everything else imports it."""

from polyfuse.core.context import SelectionContext
from polyfuse.core.platform import Platform, detect_platform
from polyfuse.core.registry import (
    NATIVE,
    Choice,
    Implementation,
    Kernels,
    OpSpec,
    declare,
    implementations,
    ops,
    register,
    resolve,
)
from polyfuse.core.runtime import DeviceRuntime, get_runtime, register_runtime


__all__ = [
    "NATIVE",
    "Choice",
    "DeviceRuntime",
    "Implementation",
    "Kernels",
    "OpSpec",
    "Platform",
    "SelectionContext",
    "declare",
    "detect_platform",
    "get_runtime",
    "implementations",
    "ops",
    "register",
    "register_runtime",
    "resolve",
]
