"""Tensor-parallel loading: each rank copies only its rows or columns of each checkpoint tensor.

The model says what its rank reads (``model.tp_shards()``: {transformers weight fragment: ``Shard``}, see
``polyfuse.distributed.sharding``); anything it does not list (embedding, norms) is read whole as at world size 1.

* safetensors: each block is read alone with ``safe_open(...).get_slice(name)[index]`` (the reader's ``slice``), so
  a rank touches about its share of the file: no rank holds the whole model in host memory, at any time;
* GGUF (and any reader without ``slice``): the tensor is read (dequantized) whole, sliced, then copied. The host
  then holds one whole dequantized tensor at a time, in float32: at most the largest tensor of the model (the
  embedding or the LM head: 49152 x 576 x 4 B = 113 MB for SmolLM2-135M, 128256 x 8192 x 4 B = 4.2 GB for
  Llama-3-70B), on every rank at once.
"""

from __future__ import annotations

from typing import Optional

import torch

from polyfuse.core.errors import CheckpointError


def tp_shards(model) -> tuple[dict, int]:
    """({fragment: Shard}, rank) of a model; ({}, 0) for a model built whole."""
    shards = model.tp_shards() if hasattr(model, "tp_shards") else {}
    return shards, getattr(getattr(model, "tp", None), "rank", 0)


def shape_of(tensor) -> Optional[tuple]:
    """A checkpoint tensor's shape without reading it (a tensor, or a safetensors reader's span; else None)."""
    if isinstance(tensor, torch.Tensor):
        return tuple(tensor.shape)
    span = getattr(tensor, "span", None)
    return tuple(span.shape) if span is not None else None


def shard_for(shards: dict, hf_name: str):
    """The ``Shard`` of checkpoint tensor ``hf_name`` (a weight or a packed component), or None: read whole."""
    return next((s for frag, s in shards.items() if f".{frag}." in f".{hf_name}"), None)


def read_blocks(tensor, dim: int, blocks) -> torch.Tensor:
    """The ``blocks`` ([start, stop) along ``dim``) of a tensor or a reader with ``slice``, concatenated."""
    pieces = []
    for start, stop in blocks:
        index = (slice(None),) * dim + (slice(start, stop),)
        pieces.append(tensor[index] if isinstance(tensor, torch.Tensor) else tensor.slice(index))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def copy_shard(dst: torch.Tensor, tensor, shards: dict, hf_name: str, rank: int) -> bool:
    """Copy this rank's part of the checkpoint tensor ``hf_name`` into ``dst`` when the model shards it; False (and
    nothing copied) when it is read whole."""
    shard = shard_for(shards, hf_name)
    if shard is None:
        return False
    if not isinstance(tensor, torch.Tensor) and (not hasattr(tensor, "slice") or shape_of(tensor) is None):
        tensor = tensor()  # a reader that cannot slice (GGUF yields whole tensors anyway): read whole, then slice
    shape = shape_of(tensor)
    if dst.dim() <= shard.dim:  # a row-parallel projection's bias: added once, by rank 0; the others hold zeros
        expected = tuple(dst.shape)
    else:
        expected = tuple(dst.shape[: shard.dim]) + (shard.size,) + tuple(dst.shape[shard.dim + 1 :])
    if shape != expected:
        raise CheckpointError(f"weight {hf_name!r} has shape {shape}, expected {expected}")
    if dst.dim() <= shard.dim:
        if rank == 0:
            dst.copy_(tensor if isinstance(tensor, torch.Tensor) else tensor())
        else:
            dst.zero_()
        return True
    offset = 0
    for start, stop in shard.blocks:
        index = (slice(None),) * shard.dim + (slice(start, stop),)
        piece = tensor[index] if isinstance(tensor, torch.Tensor) else tensor.slice(index)
        dst.narrow(shard.dim, offset, stop - start).copy_(piece)
        offset += stop - start
    return True
