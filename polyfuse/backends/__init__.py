"""Backends register implementations of the ops declared in ``polyfuse.ops``; ``registry`` picks among them."""

from polyfuse.backends.registry import (
    Choice,
    Implementation,
    Kernels,
    OpSpec,
    SelectionContext,
    implementations,
    ops,
    register,
    resolve,
)


__all__ = [
    "Choice",
    "Implementation",
    "Kernels",
    "OpSpec",
    "SelectionContext",
    "implementations",
    "ops",
    "register",
    "resolve",
]
