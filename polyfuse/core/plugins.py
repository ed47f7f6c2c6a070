"""Backends are plugins: every backend, built in or third-party, is a callable named by an entry point of the group
``polyfuse.backends`` (pyproject: ``[project.entry-points."polyfuse.backends"] name = "package.module:register"``).
The callable registers implementations (``polyfuse.core.register``) and runtimes (``register_runtime``); it is
loaded and called once, at the first resolve.

* A plugin that fails to import or to register is skipped with one warning naming it; the others still load.
* ``POLYFUSE_PLUGINS=cuda,triton`` loads only the named plugins (``POLYFUSE_PLUGINS=`` none besides native).
* Running from a source tree that was never pip-installed, the installed metadata lacks polyfuse's own entry
  points; ``BUILTIN`` holds the same three entries (a test checks they equal pyproject's), loaded the same way.
"""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint, entry_points

from polyfuse.core import settings


logger = logging.getLogger("polyfuse")

GROUP = "polyfuse.backends"
ENV_SELECT = "POLYFUSE_PLUGINS"
BUILTIN = {
    "triton": "polyfuse.backends.triton.register:register",
    "cuda": "polyfuse.backends.cuda.register:register",
    "hpu": "polyfuse.backends.hpu.register:register",
}

_state = {"loaded": False, "plugins": {}, "failed": {}}


def discovered() -> dict[str, EntryPoint]:
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    for name, value in BUILTIN.items():
        found.setdefault(name, EntryPoint(name, value, GROUP))
    wanted = settings.get(ENV_SELECT)
    if wanted is not None:
        names = {n.strip() for n in wanted.split(",") if n.strip()}
        unknown = sorted(names - set(found))
        if unknown:
            logger.warning("warning: %s names unknown backend plugin(s) %s (known: %s)", ENV_SELECT,
                           ", ".join(unknown), ", ".join(sorted(found)))  # fmt: skip
        found = {n: ep for n, ep in found.items() if n in names}
    return found


def load_plugins() -> dict[str, str]:
    """Load every plugin once; returns {name: entry point value} of those that registered."""
    if _state["loaded"]:
        return _state["plugins"]
    _state["loaded"] = True
    for name, ep in sorted(discovered().items()):
        try:
            ep.load()()
        except Exception as e:  # a broken plugin must never take the built-in backends down with it
            why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            _state["failed"][name] = why
            logger.warning("warning: polyfuse backend plugin %r (%s) skipped: %s", name, ep.value, why)
            continue
        _state["plugins"][name] = ep.value
    return _state["plugins"]


def failed_plugins() -> dict[str, str]:
    return dict(_state["failed"])


def reset_for_tests() -> None:
    _state.update(loaded=False, plugins={}, failed={})


def lazy_function(module: str, attr: str):
    """A function that imports ``module`` on its first call and forwards to ``module.attr``: a plugin registers its
    kernels without importing them (nor their compiler: triton, habana_frameworks) until one runs."""
    import importlib

    target = []

    def resolve():
        if not target:
            target.append(getattr(importlib.import_module(module), attr))
        return target[0]

    def fn(*args, **kwargs):
        if not target:
            resolve()
        return target[0](*args, **kwargs)

    fn.resolve = resolve  # torch.compile resolves first, so it never traces an import
    fn.__name__ = fn.__qualname__ = attr
    fn.__doc__ = f"{module}.{attr} (imported on first call)"
    return fn
