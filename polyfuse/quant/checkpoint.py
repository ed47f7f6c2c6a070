"""What a checkpoint holds before anything is loaded: a GGUF's tensor types, or a safetensors folder's
``quantization_config`` (AutoGPTQ, compressed-tensors fp8, polyfuse's own saves) and tensor names. The loader
(quant/quantize.py ``QuantSetup``) decides each projection's format from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from polyfuse.core.errors import CheckpointError
from polyfuse.ops.quant_formats import FP8_BLOCK, INT4_GROUP


@dataclass
class Checkpoint:
    kind: str  # dense | gguf | gptq | compressed-tensors | polyfuse
    fmt: str = ""  # gptq: int4; compressed-tensors: fp8 / fp8_block
    group_size: int = INT4_GROUP
    formats: dict = field(default_factory=dict)  # polyfuse: checkpoint module -> format
    groups: dict = field(default_factory=dict)  # polyfuse: checkpoint module -> int4 group size
    gguf_types: dict = field(default_factory=dict)  # gguf: HF weight name -> ggml type name
    keys: set = field(default_factory=set)  # safetensors tensor names
    read: Optional[Callable[[str], torch.Tensor]] = None  # safetensors: read one tensor by name
    block_scales: bool = False  # compressed-tensors 128x128 block scales (expanded to 1x128 rows at load)


def _compressed_tensors(qc: dict, where: str) -> Checkpoint:
    groups = qc.get("config_groups") or {}
    schemes = [g.get("weights") or {} for g in groups.values()]
    if not schemes or any(s.get("type") != "float" or s.get("num_bits") != 8 for s in schemes):
        raise CheckpointError(f"{where}: compressed-tensors scheme {schemes} is not supported (polyfuse reads fp8)")
    strategies = {s.get("strategy") for s in schemes}
    if len(strategies) != 1:
        raise CheckpointError(f"{where}: mixed compressed-tensors weight strategies {sorted(strategies)}")
    strategy = strategies.pop()
    if strategy in ("tensor", "channel"):
        return Checkpoint("compressed-tensors", "fp8")
    if strategy == "group" and all(s.get("group_size") == FP8_BLOCK for s in schemes):
        return Checkpoint("compressed-tensors", "fp8_block")
    if strategy == "block" and all(list(s.get("block_structure") or []) == [FP8_BLOCK, FP8_BLOCK] for s in schemes):
        return Checkpoint("compressed-tensors", "fp8_block", block_scales=True)
    raise CheckpointError(f"{where}: compressed-tensors fp8 strategy {strategy!r} is not supported")


def read_checkpoint(raw: dict, path: Optional[str], gguf_file: Optional[str], where: str) -> Checkpoint:
    """What a checkpoint folder (config.json's ``quantization_config``, tensor names) or a GGUF file (``gguf_file``:
    its path) holds."""
    if gguf_file is not None:
        from polyfuse.checkpoint.readers import gguf_name_to_hf, open_gguf

        reader = open_gguf(gguf_file)
        types = {gguf_name_to_hf(t.name): t.tensor_type.name for t in reader.tensors}
        return Checkpoint("gguf", gguf_types={k: v for k, v in types.items() if k})
    qc = raw.get("quantization_config")
    if not qc:
        return Checkpoint("dense")
    method = qc.get("quant_method")
    if method == "gptq":
        if qc.get("bits") != 4 or qc.get("checkpoint_format", "gptq") != "gptq":
            raise CheckpointError(
                f"{where}: GPTQ with bits={qc.get('bits')} checkpoint_format={qc.get('checkpoint_format')} is not "
                "supported (polyfuse reads AutoGPTQ's 4-bit layout)"
            )
        g = int(qc.get("group_size", INT4_GROUP))
        ck = Checkpoint("gptq", "int4", group_size=g)
    elif method == "compressed-tensors":
        ck = _compressed_tensors(qc, where)
    elif method == "polyfuse":
        ck = Checkpoint("polyfuse", formats=dict(qc.get("formats") or {}), groups=dict(qc.get("group_sizes") or {}))
    else:
        raise CheckpointError(
            f"{where}: quantization_config.quant_method {method!r} is not supported; polyfuse reads gptq (4-bit), "
            "compressed-tensors fp8 and its own quantized saves"
        )
    from polyfuse.checkpoint.readers import iter_safetensors

    readers = dict(iter_safetensors(path))
    ck.keys, ck.read = set(readers), (lambda name: readers[name]())
    return ck
