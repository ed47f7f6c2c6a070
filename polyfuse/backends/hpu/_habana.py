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


KERNELS = "habana_frameworks.torch.hpex.kernels"
NORMALIZATION = "habana_frameworks.torch.hpex.normalization"
OPTIMIZERS = "habana_frameworks.torch.hpex.optimizers"
CORE = "habana_frameworks.torch.core"
HPU = "habana_frameworks.torch.hpu"


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


def require(module: str, name: str) -> Any:
    component = import_component(module, name)
    if component is None:
        raise RuntimeError(f"polyfuse hpu backend: {module}.{name} not importable (run inside Habana's container)")
    return component


def clear_cache() -> None:
    import_component.cache_clear()
