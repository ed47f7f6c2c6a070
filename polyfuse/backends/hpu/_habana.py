"""Lazy, cached access to ``habana_frameworks`` (Intel Gaudi's PyTorch bridge).

Nothing in polyfuse imports ``habana_frameworks`` at import time: the package is only present inside Habana's
PyTorch containers. Every HPU implementation reaches its kernel through :func:`import_component`, which works like
optimum-habana's ``import_usable_component``: it returns the attribute, or None when the module or the attribute
cannot be imported. Results are cached; tests that put the test double on ``sys.path`` call :func:`clear_cache`.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Optional

from polyfuse.core import settings


KERNELS = "habana_frameworks.torch.hpex.kernels"
NORMALIZATION = "habana_frameworks.torch.hpex.normalization"
OPTIMIZERS = "habana_frameworks.torch.hpex.optimizers"
CORE = "habana_frameworks.torch.core"
HPU = "habana_frameworks.torch.hpu"
BRIDGE = (
    "habana_frameworks.torch"  # importing it registers the hpu device with torch (as optimum-habana's setup_device)
)
INTERNAL = "habana_frameworks.torch.utils.internal"  # is_lazy()
EXPERIMENTAL = "habana_frameworks.torch.utils.experimental"  # _get_device_type(): which Gaudi


@functools.lru_cache(maxsize=None)
def import_component(module: str, name: Optional[str] = None) -> Any:
    """``module.name`` (or the module itself when ``name`` is None), or None if it cannot be imported."""
    try:
        mod = importlib.import_module(module)
        return getattr(mod, name) if name else mod
    except (ImportError, AttributeError):
        return None


def missing_reason(module: str, name: Optional[str] = None) -> Optional[str]:
    """None when the component imports, else a one-line reason for the backend report."""
    if import_component(module, name) is not None:
        return None
    return f"{module}.{name} not importable" if name else f"{module} not importable"


# What require() found, in a plain dict: the kernels ask on every call, and under torch.compile dynamo traces that
# ask (a dict lookup it guards on) where it could not trace the import behind import_component's cache.
_FOUND: dict = {}


def require(module: str, name: str) -> Any:
    found = _FOUND.get((module, name))
    if found is not None:
        return found
    component = import_component(module, name)
    if component is None:
        if import_component(module) is not None:  # the bridge is there; this build or mode does not export the name
            raise RuntimeError(f"polyfuse hpu backend: {module} has no {name} in this Habana build or mode")
        raise RuntimeError(f"polyfuse hpu backend: {module}.{name} not importable (run inside Habana's container)")
    _FOUND[(module, name)] = component
    return component


# The kernels the HPU implementations look up on every call (require); found ahead of a torch.compile trace.
CALLED_KERNELS = ((KERNELS, "FusedSDPA"), (KERNELS, "RotaryPosEmbeddingHelperV2"), (NORMALIZATION, "FusedRMSNorm"))


def find_called_kernels() -> None:
    """Look up every kernel of CALLED_KERNELS that imports, so that a traced call finds it in ``_FOUND``."""
    for module, name in CALLED_KERNELS:
        if import_component(module, name) is not None:
            require(module, name)


def import_bridge() -> bool:
    """Import ``habana_frameworks.torch`` (registers the hpu device with torch); False outside Habana's stack."""
    return import_component(BRIDGE) is not None


def is_lazy() -> bool:
    """Habana's own answer (``habana_frameworks.torch.utils.internal.is_lazy()``: ``PT_HPU_LAZY_MODE``, read once per
    process; unset means eager since Synapse 1.21). Without the bridge, the same rule on the environment."""
    fn = import_component(INTERNAL, "is_lazy")
    if fn is not None:
        return bool(fn())
    return settings.get("PT_HPU_LAZY_MODE")


@functools.lru_cache(maxsize=None)
def generation() -> Optional[str]:
    """The Gaudi generation, "gaudi", "gaudi2" or "gaudi3", as Habana's ``_get_device_type()`` says (what Intel
    Neural Compressor and optimum-habana ask to pick the fp8 range); None without the bridge or for a device it does
    not name. Asked once per process (``clear_cache`` forgets it), not on every projection call."""
    get = import_component(EXPERIMENTAL, "_get_device_type")
    kinds = import_component(EXPERIMENTAL, "synDeviceType")
    if get is None or kinds is None:
        return None
    found = get()
    for name in ("gaudi", "gaudi2", "gaudi3"):
        if found == getattr(kinds, "synDevice" + name.capitalize(), object()):
            return name
    return None


def clear_cache() -> None:
    _FOUND.clear()
    import_component.cache_clear()
    generation.cache_clear()
