"""Habana's ecosystem variables, read or set in this one place (polyfuse's own settings are named options). The
declarations follow core/settings.py's form, to move there when that module lands:

* ``QUANT_CONFIG`` (read): Intel Neural Compressor's fp8 configuration file, as optimum-habana's run_generation.py
  reads it (``os.getenv("QUANT_CONFIG", "")``): a JSON with ``mode`` MEASURE (calibrate and write measurements) or
  QUANTIZE (read them and run fp8). Unset or empty: no INC.
* ``PT_HPU_ENABLE_LAZY_COLLECTIVES`` (set): collectives inside lazy-mode graphs; tensor parallelism with HPU graphs
  fails at capture without it. optimum-habana sets it to ``true`` where unset for every multi-card run
  (text-generation utils.py ``setup_env``), before the bridge starts; so does :func:`enable_lazy_collectives`.
* ``WORLD_SIZE`` (read, torchrun's): whether this process is one of several.
"""

from __future__ import annotations

import os
from typing import Optional


LAZY_COLLECTIVES = "PT_HPU_ENABLE_LAZY_COLLECTIVES"
QUANT_CONFIG = "QUANT_CONFIG"
_FALSE = ("", "0", "false", "no", "off")


def quant_config() -> Optional[str]:
    """The INC configuration file QUANT_CONFIG names, or None when unset or empty."""
    value = os.environ.get(QUANT_CONFIG, "")
    return value or None


def world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def enable_lazy_collectives() -> None:
    """``PT_HPU_ENABLE_LAZY_COLLECTIVES=true`` where unset, as optimum-habana does for multi-card runs."""
    os.environ.setdefault(LAZY_COLLECTIVES, "true")


def lazy_collectives() -> bool:
    return os.environ.get(LAZY_COLLECTIVES, "").strip().lower() not in _FALSE
