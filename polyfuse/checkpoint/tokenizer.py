"""Tokenizers for local checkpoints. A GGUF's tokenizer is converted by transformers once (slow) and cached as a
tokenizer folder under ``$POLYFUSE_CACHE`` (default ~/.cache/polyfuse), keyed by the file's size and mtime and by
transformers' version (the saved folder's format follows the transformers that wrote it: 5.x writes tokenizer_class
"TokenizersBackend", which 4.x cannot load)."""

from __future__ import annotations

import hashlib
import os
import shutil

import transformers
from transformers import AutoTokenizer

from polyfuse.core import settings


# Part of the cache key: bump when what is cached changes (2: special tokens as the GGUF says, _gguf_special_tokens).
CACHE_FORMAT = 2


def cache_root() -> str:
    return settings.cache_dir()


def _gguf_special_tokens(tok, file: str) -> None:
    """BOS / EOS and add_bos_token as the GGUF's metadata says. transformers 4.55's GGUF conversion makes the BOS
    token the EOS too (SmolLM2: eos "<|im_start|>" instead of "<|im_end|>") and always prepends a BOS (Llama's
    default) where the file says not to; 5.x follows the file, and then nothing here changes."""
    from polyfuse.checkpoint.readers import open_gguf

    fields = open_gguf(file).fields

    def field(key):
        f = fields.get("tokenizer.ggml." + key)
        return None if f is None else f.contents()

    for name in ("bos", "eos"):
        idx = field(f"{name}_token_id")
        if idx is not None and 0 <= int(idx) < len(tok):
            token = tok.convert_ids_to_tokens(int(idx))
            if getattr(tok, f"{name}_token") != token:
                setattr(tok, f"{name}_token", token)
    add_bos = field("add_bos_token")
    if add_bos is not None and getattr(tok, "add_bos_token", bool(add_bos)) != bool(add_bos):
        tok.add_bos_token = bool(add_bos)  # LlamaTokenizerFast rebuilds its post-processor


def _save_atomically(tok, cached: str) -> None:
    """Write the converted tokenizer beside ``cached`` and rename it into place, so a process reading the cache
    never sees a half-written folder (two runs, or two test workers, converting at once)."""
    tmp = f"{cached}.tmp-{os.getpid()}"
    try:
        tok.save_pretrained(tmp)
        os.rename(tmp, cached)
    except OSError:
        pass  # read-only home, or another process renamed its copy first: convert again next time
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(path: str, gguf_file: str | None = None):
    """The checkpoint's tokenizer set up for batched generation: left padding, EOS as the pad token where none."""
    tok = original_tokenizer(path, gguf_file)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def original_tokenizer(path: str, gguf_file: str | None = None):
    """The checkpoint's tokenizer as stored (a GGUF's converted once and cached)."""
    if gguf_file is None:
        tok = AutoTokenizer.from_pretrained(path)
    else:
        file = gguf_file if os.path.isabs(gguf_file) else os.path.join(path, gguf_file)
        st = os.stat(file)
        ident = f"{os.path.abspath(file)}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}:{CACHE_FORMAT}"
        key = hashlib.sha1(ident.encode()).hexdigest()[:16]
        cached = os.path.join(cache_root(), "tokenizers", key)
        if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
            tok = AutoTokenizer.from_pretrained(cached)
        else:
            tok = AutoTokenizer.from_pretrained(os.path.dirname(file), gguf_file=os.path.basename(file))
            _gguf_special_tokens(tok, file)
            _save_atomically(tok, cached)
    return tok
