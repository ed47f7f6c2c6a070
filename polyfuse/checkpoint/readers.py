"""Checkpoint readers: iterate (HF weight name, tensor) pairs from a safetensors folder (sharded or not) or a GGUF
file, one tensor at a time, so a model never needs a second full copy of its weights in RAM."""

from __future__ import annotations

import functools
import glob
import json
import os
import threading
from typing import Callable, Iterator

import torch

from polyfuse.checkpoint.staging import read_spans, with_span
from polyfuse.core.errors import CheckpointError, one_line


def iter_safetensors(path: str) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, reader) for every tensor of a safetensors checkpoint; each reader returns the tensor on the CPU
    (memory-mapped file, one tensor at a time) and may run on any thread."""
    from safetensors import SafetensorError, safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({one_line(e)})") from None
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights found")
    local = threading.local()

    def reader(file: str, key: str):
        def handle():
            handles = local.__dict__.setdefault("handles", {})
            if file not in handles:
                handles[file] = safe_open(file, framework="pt")
            return handles[file]

        def read() -> torch.Tensor:
            return handle().get_tensor(key)

        def read_slice(index) -> torch.Tensor:
            # A tensor-parallel rank reads only its rows or columns (get_slice), through a mapping of its own that
            # is dropped at once: the file's pages it touched leave the process's resident memory with it.
            with safe_open(file, framework="pt") as f:
                return f.get_slice(key)[index]

        read.slice = read_slice
        return read

    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: listed in the index but missing")
        try:
            with safe_open(file, framework="pt") as f:
                keys = list(f.keys())
        except SafetensorError as e:
            raise CheckpointError(f"{file}: corrupt safetensors file ({one_line(e)})") from None
        spans = read_spans(file)  # where each tensor's bytes lie: the loader reads them in place (staging.py)
        for key in keys:
            yield key, with_span(reader(file, key), spans[key])


_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Architectures whose q/k rows llama.cpp's converter interleaved for its rotary layout (undone at load).
_PERMUTED = ("llama",)


def gguf_name_to_hf(name: str) -> str | None:
    parts = name.split(".")
    suffix = parts[-1]
    if parts[0] == "blk":
        mapped = _GGUF_NAMES.get(parts[2])
        return f"model.layers.{parts[1]}.{mapped}.{suffix}" if mapped else None
    mapped = _GGUF_NAMES.get(parts[0])
    return f"{mapped}.{suffix}" if mapped else None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp stores q/k rows interleaved for its rotary layout; undo it to get HF's rotate-half layout.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


@functools.lru_cache(maxsize=2)
def _gguf_reader(file: str, size: int, mtime_ns: int):
    import gguf

    return gguf.GGUFReader(file)


def open_gguf(file: str):
    """A GGUF reader (memory-mapped). Parsing the metadata (a tokenizer's vocabulary) takes seconds, and a load opens
    the file more than once (model type, config, tensors; every tensor-parallel rank): the last two files' readers
    are kept, keyed by path, size and modification time."""
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: no such GGUF file")
    try:
        st = os.stat(file)
        return _gguf_reader(os.path.abspath(file), st.st_size, st.st_mtime_ns)
    except Exception as e:
        raise CheckpointError(f"{file}: not a readable GGUF file ({type(e).__name__}: {one_line(e)})") from None


def iter_gguf(reader, config, arch: str = "llama", keep=()) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float tensor) per GGUF tensor, dequantized; the HF weight names in ``keep`` come as stored instead:
    ``<module>.qweight``, the raw blocks [rows, bytes] (uint8), for a quantized projection (quant/quantize.py)."""
    from gguf.quants import dequantize

    permuted = arch in _PERMUTED
    for t in reader.tensors:
        name = gguf_name_to_hf(t.name)
        if name is None:
            continue
        if name in keep:  # rows of whole blocks: the row permutation below applies to them as to floats
            w, name = torch.from_numpy(t.data.copy()), name[: -len("weight")] + "qweight"
        else:
            w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        if permuted and name.endswith(("q_proj.weight", "q_proj.qweight")):
            w = _unpermute(w, config.num_attention_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.qweight")):
            w = _unpermute(w, config.num_key_value_heads)
        yield name, w
