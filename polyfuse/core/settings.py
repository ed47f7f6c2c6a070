"""The environment variables polyfuse reads or sets, each declared once: name, type, default, meaning, and whose
variable it is. polyfuse's own settings are named options (run flags, ``from_pretrained`` keywords, CLI flags:
``polyfuse.core.kernel_options``); a variable is here only where the ecosystem expects one (torchrun's ranks,
Habana's mode, Triton's interpreter) or where a process is configured by its environment (``POLYFUSE_OPS`` in the
manner of vLLM's ``VLLM_*``, ``POLYFUSE_PLUGINS``, ``POLYFUSE_CACHE``).

Read a variable with :func:`get` when it is needed, never into a module global at import; set one for a child
library or process with :func:`set_for_child`. tests/test_settings.py fails on any ``os.environ`` read elsewhere in
polyfuse/. :func:`describe` lists them all (docs/architecture.md, "Settings").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Variable:
    name: str
    type: type  # str, int, float or bool
    default: Any  # what get() returns when the variable is unset (None: "unset" is a value of its own)
    meaning: str
    owner: str = "polyfuse"  # whose variable it is: polyfuse, or the library / launcher that defines it
    read: bool = True  # False: polyfuse only sets it (for a library it starts)


_CACHE = os.path.join("~", ".cache", "polyfuse")
_VARIABLES = (
    Variable("POLYFUSE_OPS", str, "", "per-op overrides applied before a run's own --ops / overrides= (e.g. "
             "'-rotary,attention=sdpa_flash')"),
    Variable("POLYFUSE_PLUGINS", str, None, "comma-separated backend plugins to load (unset: all; empty: none, "
             "native ops only)"),
    Variable("POLYFUSE_CACHE", str, _CACHE, "folder for downloaded tokenizers of GGUF checkpoints"),
    Variable("POLYFUSE_API_KEY", str, None, "the key `polyfuse serve` requires as `Authorization: Bearer` when "
             "--api_key is not given"),
    Variable("POLYFUSE_DIST_TIMEOUT", float, 600.0, "seconds a rank waits for the others in a collective "
             "(torchrun runs; every rank reads it)"),
    Variable("POLYFUSE_DESTROY_TIMEOUT_S", float, 20.0, "seconds a rank waits for destroy_process_group at exit "
             "before it exits without it"),
    Variable("POLYFUSE_DESTROY_STACKS", bool, False, "with a destroy past its timeout, also print every thread's "
             "Python stack"),
    Variable("RANK", int, None, "this process's rank", "torchrun"),
    Variable("WORLD_SIZE", int, 1, "processes in the run", "torchrun"),
    Variable("LOCAL_RANK", int, None, "this process's rank on its host (its device index)", "torchrun"),
    Variable("PT_HPU_LAZY_MODE", bool, False, "Habana lazy mode; asked only where the bridge cannot be (its own "
             "is_lazy() answers otherwise)", "Habana"),
    Variable("PT_HPU_ENABLE_LAZY_COLLECTIVES", bool, False, "collectives inside lazy-mode HPU graphs; polyfuse sets "
             "it to true where unset for a multi-card run, as optimum-habana does", "Habana"),
    Variable("QUANT_CONFIG", str, None, "Intel Neural Compressor's fp8 configuration (mode MEASURE or QUANTIZE), read "
             "by run_generation.py as optimum-habana's reads it", "Intel Neural Compressor"),
    Variable("TRITON_INTERPRET", bool, False, "run Triton kernels in the CPU interpreter (the tests do)", "Triton"),
    Variable("FSDP_SYNC_MODULE_STATES", str, None, "set to false for a CPU-only FSDP run that did not ask for it",
             "accelerate", read=False),
    Variable("OMP_NUM_THREADS", str, None, "set to 1 by examples/spawn.py where unset, as torchrun does", "torch",
             read=False),
)  # fmt: skip
VARIABLES = {v.name: v for v in _VARIABLES}
_FALSE = ("", "0", "false", "no", "off")


def _declared(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in polyfuse/core/settings.py") from None


def _parse(var: Variable, raw: str):
    if var.type is bool:
        return raw.strip().lower() not in _FALSE
    if var.type is str:
        return raw
    try:
        return var.type(raw)
    except ValueError:
        raise ValueError(f"{var.name}={raw!r}: expected {var.type.__name__}") from None


def get(name: str, default: Any = None) -> Any:
    """The variable's value, parsed to its type, read now; ``default`` (else the declared default) when unset.
    An undeclared name raises KeyError: every variable polyfuse reads is in this file."""
    var = _declared(name)
    raw = os.environ.get(name)
    if raw is None:
        return var.default if default is None else default
    return _parse(var, raw)


def is_set(name: str) -> bool:
    _declared(name)
    return name in os.environ


def set_for_child(name: str, value: str, overwrite: bool = True) -> None:
    """Set a declared variable for a library or process this one starts (``overwrite=False``: only where unset)."""
    _declared(name)
    if overwrite or name not in os.environ:
        os.environ[name] = value


def cache_dir() -> str:
    return os.path.expanduser(get("POLYFUSE_CACHE"))


def describe() -> str:
    """Every variable as a Markdown table (docs/architecture.md, "Settings")."""
    lines = ["| variable | type | default | whose | meaning |", "| --- | --- | --- | --- | --- |"]
    for v in _VARIABLES:
        default = "unset" if v.default is None else repr(v.default)
        kind = v.type.__name__ + ("" if v.read else ", set only")
        lines.append(f"| `{v.name}` | {kind} | {default} | {v.owner} | {v.meaning} |")
    return "\n".join(lines)
