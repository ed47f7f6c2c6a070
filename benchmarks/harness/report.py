"""Writing benchmark results: the JSON file (atomically, so a run killed mid-write leaves the previous version), the
markdown table rows the scripts print, and the results files (benchmarks/results/*.jsonl, one JSON object a line)
that benchmarks/make_table.py turns into docs/benchmarks.md."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import shlex
import sys


# which results file a figure row goes to when --results names a folder; rows of other kinds are not results
RESULT_FILES = {
    "decode": "decode.jsonl",
    "block_decode": "decode.jsonl",
    "prefill": "prefill.jsonl",
    "load_to_gpu_s": "load.jsonl",
    "train_step": "training.jsonl",
    "lora_step": "lora.jsonl",
    "fsdp_step": "fsdp.jsonl",
    "perplexity": "perplexity.jsonl",
    "linear": "linear.jsonl",
    "spec_verify": "speculative.jsonl",
    "spec_replay": "speculative.jsonl",
    "spec_lookup": "speculative.jsonl",
}
VERSIONED = ("transformers", "triton", "accelerate", "peft", "torchao", "liger-kernel")


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


def run_meta(device: str) -> dict:
    """What every results row carries besides its figures: today's date, the device, the versions, the command."""
    import torch

    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's: the command is then a torchrun one
    launcher = f"torchrun --nproc-per-node {world}" if world > 1 else "python"
    command = f"{launcher} {shlex.join(sys.argv)}"
    return {"date": datetime.date.today().isoformat(), "device": device, "versions": versions, "command": command}


def append_result(path, row: dict, meta: dict) -> None:
    """Append one figure row (``row["what"]`` in RESULT_FILES) with ``meta`` to the JSON-lines file ``path``, or, where
    ``path`` is a folder, to that folder's file for the row's kind (tensor-parallel decode: tensor_parallel.jsonl)."""
    if not path or row.get("what") not in RESULT_FILES:
        return
    if os.path.isdir(path):
        tp = row.get("tp", 1) > 1
        path = os.path.join(path, "tensor_parallel.jsonl" if tp else RESULT_FILES[row["what"]])
    figures = {k: v for k, v in row.items() if k not in ("what", "date", "device", "versions", "command")}
    out = {"what": row["what"], "date": meta["date"], "device": meta["device"], **figures,
           "versions": meta["versions"], "command": meta["command"]}  # fmt: skip
    with open(path, "a") as f:  # one write of one line: a run killed later keeps the rows before it
        f.write(json.dumps(out) + "\n")


class RowSink:
    """Where a benchmark's JSON rows go besides stdout: every row to ``output`` (appended), the figure rows with
    :func:`run_meta` to ``results`` (see :func:`append_result`)."""

    def __init__(self, output=None, results=None, device: str = "cpu"):
        self.file = open(output, "a") if output else None
        self.results = results
        self.meta = run_meta(device) if results else None

    def write(self, row: dict) -> None:
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.results:
            append_result(self.results, row, self.meta)

    def close(self) -> None:
        if self.file:
            self.file.close()
