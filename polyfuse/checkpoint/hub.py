"""A checkpoint named the way transformers names one: a local folder, or a Hub repo id (with ``revision``,
``subfolder``, ``token``, ``cache_dir``, ``local_files_only``) resolved to the local snapshot huggingface_hub keeps
(downloaded unless offline; ``HF_HUB_OFFLINE`` is huggingface_hub's own setting)."""

from __future__ import annotations

import os
from typing import Optional

from polyfuse.core.errors import CheckpointError


# What a safetensors checkpoint folder needs: configs, weights, tokenizer files.
FOLDER_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def local_checkpoint(
    path, gguf_file: Optional[str] = None, revision: Optional[str] = None, subfolder: str = "", **hub
) -> str:
    """The local folder holding ``path``'s checkpoint. ``hub``: huggingface_hub's ``token``, ``cache_dir``,
    ``local_files_only``, passed to ``snapshot_download``; a local folder never reads them."""
    path = os.fspath(path)
    local = os.path.join(path, subfolder) if subfolder else path
    if os.path.isdir(local) or (gguf_file is not None and os.path.isabs(gguf_file)):
        return local
    if os.path.isfile(path):  # a .gguf file is a checkpoint; the loader says what any other file is not
        return path
    if os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise CheckpointError(f"{path}: no such checkpoint folder")
    from huggingface_hub import snapshot_download

    want = [gguf_file, "*.json", "tokenizer*"] if gguf_file is not None else FOLDER_PATTERNS
    if subfolder:
        want = [f"{subfolder}/{p}" for p in want]
    kw = {k: v for k, v in hub.items() if v is not None}
    try:
        root = snapshot_download(repo_id=path, revision=revision, allow_patterns=want, **kw)
    except Exception as e:  # huggingface_hub's errors (offline, unknown repo or revision, auth) as one line
        where = f"{path}@{revision}" if revision else path
        raise CheckpointError(f"{where}: not a local folder and not loadable from the Hub: {e}") from e
    return os.path.join(root, subfolder) if subfolder else root
