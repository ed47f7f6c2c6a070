"""Tokenizers for local checkpoints. A GGUF's tokenizer is converted by transformers once (slow) and cached as a
tokenizer folder under ``$POLYFUSE_CACHE`` (default ~/.cache/polyfuse), keyed by the file's size and mtime."""

from __future__ import annotations

import hashlib
import os

from transformers import AutoTokenizer


def cache_root() -> str:
    return os.environ.get("POLYFUSE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "polyfuse"))


def load_tokenizer(path: str, gguf_file: str | None = None):
    if gguf_file is None:
        tok = AutoTokenizer.from_pretrained(path)
    else:
        file = gguf_file if os.path.isabs(gguf_file) else os.path.join(path, gguf_file)
        st = os.stat(file)
        key = hashlib.sha1(f"{os.path.abspath(file)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cached = os.path.join(cache_root(), "tokenizers", key)
        if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
            tok = AutoTokenizer.from_pretrained(cached)
        else:
            tok = AutoTokenizer.from_pretrained(os.path.dirname(file), gguf_file=os.path.basename(file))
            try:
                tok.save_pretrained(cached)
            except OSError:
                pass  # read-only home: convert again next time
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok
