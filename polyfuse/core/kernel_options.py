"""Named options of the kernels a run gets: declared once here, set as run flags (``flags={"int4_a8": True}``), as
keyword arguments of ``AutoModelForCausalLM.from_pretrained`` / ``from_config``, or as CLI flags
(polyfuse/cli/kernel_options.py). They reach the registry in the ``SelectionContext``'s flags; an implementation that
registers with ``options=True`` is called with the run's :class:`KernelOptions` as the keyword ``options`` (and so
are its ``accepts``), so two models in one process can run with different options. ``Kernels.report()`` names the
options a run set."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field


def _option(default, help: str, metavar: str = ""):
    return field(default=default, metadata={"help": help, "metavar": metavar})


@dataclass(frozen=True)
class KernelOptions:
    int4_a8: bool = _option(
        False,
        "W4A8: one-row int4 on int8 activations (blocks of 32, as llama.cpp; not weight-only)",
    )
    gguf_a8: bool = _option(
        True,
        "GGUF blocks: 1..8-row projections on int8 activations (as llama.cpp); off: float activations",
    )
    int4_mma: bool = _option(True, "int4 with 2..16 rows on the tensor-core GEMM")
    fp8_fast_accum: bool = _option(
        False,
        "fp8 GEMMs without Hopper's float32 promotion of partial sums: faster prefill, less exact",
    )
    pdl: bool = _option(True, "programmatic dependent launch of the decode kernels (NVIDIA 9.0+)")
    tile_configs: str = _option(
        "",
        "folder of tile tables (<kind>/<GPU name>.json) whose entries replace the package's (docs/architecture.md)",
        "DIR",
    )


DEFAULT = KernelOptions()
FIELDS = {f.name: f for f in dataclasses.fields(KernelOptions)}


def _checked(name: str, value):
    f = FIELDS[name]
    want = type(f.default)
    if want is bool and not isinstance(value, bool):
        raise TypeError(f"kernel option {name} must be True or False, not {value!r}")
    if want is str and not isinstance(value, str):
        value = str(value)  # a path
    if name == "tile_configs" and value and not os.path.isdir(value):
        raise ValueError(f"kernel option tile_configs: {value!r} is not a folder")
    return value


def from_flags(flags: dict) -> KernelOptions:
    """The options among a run's flags (the rest of the flags are not options); the defaults for those absent."""
    given = {n: _checked(n, flags[n]) for n in FIELDS if flags.get(n) is not None}
    return dataclasses.replace(DEFAULT, **given) if given else DEFAULT


def merge(flags, options: dict) -> dict:
    """``flags`` (or None) with the keyword options of ``from_pretrained`` added; TypeError names an unknown one."""
    unknown = sorted(set(options) - set(FIELDS))
    if unknown:
        raise TypeError(f"unknown keyword argument(s) {', '.join(unknown)}; kernel options: {', '.join(FIELDS)}")
    if not options:
        return flags
    out = dict(flags or {})
    out.update({n: _checked(n, v) for n, v in options.items()})
    return out


def changed(options: KernelOptions) -> dict:
    """The options that differ from their defaults, {name: value}."""
    return {n: getattr(options, n) for n in FIELDS if getattr(options, n) != getattr(DEFAULT, n)}
