"""Writing benchmark results: the JSON file (atomically, so a run killed mid-write leaves the previous version) and
the rows of the markdown tables docs/benchmarks.md quotes."""

from __future__ import annotations

import json
import os


def write_json(results: dict, path) -> None:
    """``results`` as indented JSON at ``path`` (nothing when ``path`` is empty): a temporary file, then renamed."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp, path)


def markdown_row(cells) -> str:
    """One markdown table row; a missing value (None) is shown as "-"."""
    return "| " + " | ".join("-" if v is None else str(v) for v in cells) + " |"
