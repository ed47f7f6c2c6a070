"""Write any polyfuse model as a transformers checkpoint: config.json + safetensors in transformers' weight names
(the load-time fusions split back), sharded above a size, with generation_config.json and the tokenizer the model
was loaded with. A float save loads in transformers as is; a quantized one in polyfuse's own format carries an empty
``.weight`` beside each packed projection, so transformers without polyfuse refuses it (a size mismatch) instead of
running that projection on random weights (docs/quantization.md).

Every file is first written complete into a hidden staging folder inside the target folder (same filesystem), then
moved into place with ``os.replace``: an error or Ctrl-C while writing leaves the folder as it was (the staging
folder is removed), never a half-written file a later load would trust. A save into a folder that already holds a
checkpoint removes that checkpoint's weight files and index (``model*.safetensors``,
``model.safetensors.index.json``; nothing else) so its shards cannot be read back in place of the new weights.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid

from polyfuse.compat import set_config_dtype
from polyfuse.loader.hf_files import save_tokenizer
from polyfuse.loader.load import hf_state_items
from polyfuse.quant.quantize import quantized_state_items, refusal_placeholders


INDEX_NAME = "model.safetensors.index.json"


def _previous_weight_files(path: str) -> list[str]:
    """The weight files and index of a checkpoint already in ``path`` (what a loader could read)."""
    files = glob.glob(os.path.join(glob.escape(path), "model*.safetensors"))
    index = os.path.join(path, INDEX_NAME)
    return sorted(f for f in files if os.path.isfile(f)) + ([index] if os.path.isfile(index) else [])


def save_pretrained(model, path: str, max_shard_bytes: int = 4 << 30, params=None) -> None:
    """``params``: (name, tensor) pairs in the model's own names written instead of its parameters (the full state
    dict FSDP2 gathers on rank 0; a sharded model's parameters hold one rank's part)."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{path}: exists and is not a folder")
    os.makedirs(path, exist_ok=True)
    config = model.config
    config.architectures = [model.hf_architecture]
    set_config_dtype(config, model.dtype)  # config.dtype; torch_dtype before transformers 4.56
    staging = os.path.join(path, f".polyfuse-save-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(staging)
    try:
        config.save_pretrained(staging)
        extras = _write_extras(model, staging)
        shards, current, size = [], {}, 0
        packed = [*quantized_state_items(model), *refusal_placeholders(model)] if params is None else []
        for name, t in [*hf_state_items(model, params), *packed]:
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue
            if current and size + t.numel() * t.element_size() > max_shard_bytes:
                shards.append(current)
                current, size = {}, 0
            current[name] = t.detach().contiguous().cpu()
            size += t.numel() * t.element_size()
        shards.append(current)
        if len(shards) == 1:
            weights = {"model.safetensors": shards[0]}
        else:
            weights = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}
        for fname, shard in weights.items():
            save_file(shard, os.path.join(staging, fname), metadata={"format": "pt"})
        if len(weights) > 1:
            weight_map = {name: fname for fname, shard in weights.items() for name in shard}
            with open(os.path.join(staging, INDEX_NAME), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
        # Everything is written: swap it in. The old index goes first (while it exists a loader reads the old
        # shards), then old weight files the new ones do not overwrite; the new index (which makes the new shards
        # one checkpoint) and config.json come last. Each step is one atomic rename or unlink.
        for old in sorted(_previous_weight_files(path), key=lambda f: not f.endswith(INDEX_NAME)):
            if os.path.basename(old) not in weights:
                os.remove(old)
        for fname in [*extras, *weights, *([INDEX_NAME] if len(weights) > 1 else []), "config.json"]:
            os.replace(os.path.join(staging, fname), os.path.join(path, fname))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_extras(model, staging: str) -> list:
    """generation_config.json and the tokenizer the model was loaded with, into ``staging``; their file names."""
    before = set(os.listdir(staging))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(staging)
    save_tokenizer(getattr(model, "tokenizer_source", None), staging)
    return sorted(set(os.listdir(staging)) - before - {"config.json"})
