"""Tuned tile tables as data: ``configs/<kind>/<GPU name>.json`` (the name ``torch.cuda.get_device_name`` reports,
non-word characters as ``_``: ``NVIDIA_H200.json``), else ``configs/<kind>/default.json``, else none.

Kinds: ``gemv`` (the one-row bf16 GEMV: the shapes where it beat cuBLAS, with their tiles; only the H200 has one,
and no default: a GPU without a table keeps cuBLAS), ``qgemv`` (the quantized one-row GEMVs, per format: its tile,
per-shape tiles, programs per multiprocessor, weight registers loaded before the PDL wait, multi-row tiles) and
``qgemm`` (the few-row dequantizing GEMMs' tiles per format). The qgemv and qgemm defaults were swept on an H200 and
run on every GPU nobody tuned: a kernel needs some tile, and every tile gives the same numbers, only at another speed.

The kernel option ``tile_configs`` (a folder in the same layout) overrides them: each top-level entry of its table
(a format, or for gemv ``linear`` / ``swiglu_linear``) replaces the package's entry of that name whole.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch


CONFIGS = Path(__file__).with_name("configs")


def file_name(device_name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", device_name.strip()) + ".json"


@functools.lru_cache(maxsize=None)
def _gpu_name(device_type: str, index) -> str:
    if device_type != "cuda" or not torch.cuda.is_available():
        return ""
    return torch.cuda.get_device_name(torch.cuda.current_device() if index is None else index)


def gpu_name(device) -> str:
    """The product name of ``device``'s GPU ("" for anything else, the CPU interpreter included)."""
    device = torch.device(device)
    return _gpu_name(device.type, device.index)


def _read(folder: Path, device_name: str) -> dict:
    names = ([file_name(device_name)] if device_name else []) + ["default.json"]
    for name in names:
        path = folder / name
        if path.is_file():
            try:
                return json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ValueError(f"tile table {path}: {e}") from None
    return {}


@functools.lru_cache(maxsize=None)
def table(kind: str, device_name: str, override: str = "") -> dict:
    """The ``kind`` table for the GPU named ``device_name``: the package's, with ``override``'s entries (a folder:
    the tile_configs option) replacing those of the same name. Keys starting with ``_`` (notes) are dropped."""
    out = _read(CONFIGS / kind, device_name)
    if override:
        if not Path(override).is_dir():
            raise ValueError(f"tile_configs {override!r} is not a folder")
        out = {**out, **_read(Path(override) / kind, device_name)}
    return {k: v for k, v in out.items() if not k.startswith("_")}


def shape_key(text: str) -> tuple:
    """``"4096,14336"`` -> (4096, 14336)."""
    return tuple(int(p) for p in text.split(","))
