"""The files of a checkpoint besides its weights, read and written as transformers does: the config (or a config
object the caller gives, plus attribute updates), ``generation_config.json`` (the defaults ``generate`` starts from;
a GGUF or a folder without one: transformers' ``GenerationConfig.from_model_config``) and the tokenizer a save
writes beside the weights (from the folder or GGUF the model was loaded from), so a saved folder is complete."""

from __future__ import annotations

import logging
import os
from typing import Optional

from polyfuse.core.errors import CheckpointError


logger = logging.getLogger("polyfuse")

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")
# Config fields that describe a file, not the model: never taken from a caller's config object.
_FILE_FIELDS = (
    "quantization_config",
    "transformers_version",
    "architectures",
    "_name_or_path",
    "dtype",
    "torch_dtype",
)


def checkpoint_fields(raw: dict, config=None, updates: Optional[dict] = None, config_class=None) -> dict:
    """The config dict a model is built from: the checkpoint's, or ``config``'s fields over it (what a caller such
    as transformers' Auto classes passes as ``config=``), then ``updates`` (attributes of ``config_class``)."""
    raw = dict(raw)
    if config is not None:
        if config.model_type != raw.get("model_type"):
            raise CheckpointError(
                f"config= is a {config.model_type} config; the checkpoint is {raw.get('model_type')}"
            )
        raw.update((k, v) for k, v in config.to_dict().items() if k not in _FILE_FIELDS)
    defaults = config_class() if updates and config_class is not None else None
    for key, value in (updates or {}).items():
        if key not in raw and not hasattr(defaults, key):
            raise TypeError(f"from_pretrained() got an unexpected keyword argument {key!r}")
        raw[key] = value
    return raw


def generation_config_for(path: Optional[str], gguf_file: Optional[str], config):
    """The checkpoint's generation_config.json, else the defaults transformers derives from the model config."""
    from transformers import GenerationConfig

    if gguf_file is None and path is not None and os.path.isfile(os.path.join(path, GENERATION_CONFIG)):
        return GenerationConfig.from_pretrained(path)
    return GenerationConfig.from_model_config(config)


def tokenizer_source(path: Optional[str], gguf_file: Optional[str]) -> Optional[tuple]:
    """(folder, gguf file or None) holding the checkpoint's tokenizer, None where it has none."""
    if gguf_file is not None:
        from polyfuse.checkpoint.readers import open_gguf

        file = gguf_file if os.path.isabs(gguf_file) or path is None else os.path.join(path, gguf_file)
        return (path, gguf_file) if "tokenizer.ggml.tokens" in open_gguf(file).fields else None
    if path is not None and any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return (path, None)
    return None


def save_tokenizer(source: Optional[tuple], folder: str) -> None:
    """Write the tokenizer loaded from ``source`` into ``folder`` (a GGUF's: converted, as transformers reads it)."""
    if source is None:
        return
    from polyfuse.checkpoint.tokenizer import original_tokenizer

    try:
        tok = original_tokenizer(*source)
    except (OSError, ValueError, TypeError) as e:  # moved, or transformers cannot read it: the weights still save
        logger.warning("warning: the tokenizer of %s was not saved: %s", source[0], e)
        return
    tok.save_pretrained(folder)
