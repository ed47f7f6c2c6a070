"""Model-agnostic configuration reading: a checkpoint folder's config.json, or a GGUF file's metadata, as the plain
fields transformers' config classes take. Which config class (and so which family) is the model's business."""

from __future__ import annotations

import json
import os

from polyfuse.compat import config_kwargs
from polyfuse.core.errors import CheckpointError, one_line


# Sizes every family reads as integers. transformers 5 type-checks them when the config is built; 4.x takes any
# value and the build fails later with a bare TypeError, so they are checked here, on every version.
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings",
)  # fmt: skip


def head_dim(config) -> int:
    """The attention head size: ``config.head_dim`` when set, else hidden / heads (transformers' rule)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def read_config_dict(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face checkpoint folder or --gguf_file)")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object")
    return raw


def config_from_dict(config_class, raw: dict, where: str):
    for key in INT_FIELDS:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise CheckpointError(
                f"{where}: invalid {raw.get('model_type')} config ({key} must be an integer, got {value!r})"
            )
    try:
        # A 5.x config.json (or GGUF fields) says rope_parameters; transformers 4.x needs rope_theta + rope_scaling.
        return config_class.from_dict(config_kwargs(raw))
    except Exception as e:  # transformers validates rope parameters and sizes
        raise CheckpointError(f"{where}: invalid {raw.get('model_type')} config ({one_line(e)})") from None


def gguf_architecture(reader) -> str:
    f = reader.fields.get("general.architecture")
    return f.contents() if f is not None else ""


def gguf_config_fields(reader, path: str) -> dict:
    """The transformers config fields a GGUF's metadata gives (keys prefixed by its architecture, llama.cpp's
    convention: ``qwen2.block_count``, ...)."""

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = gguf_architecture(reader)
    p = arch + "."

    def required(key):
        value = field(p + key)
        if value is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {p + key}")
        return int(value)

    n_heads = required("attention.head_count")
    hidden = required("embedding_length")
    vocab = field(p + "vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    rope = {"rope_type": "default", "rope_theta": float(field(p + "rope.freq_base", 10000.0))}
    if field(p + "rope.scaling.type") == "linear":
        rope.update(rope_type="linear", factor=float(field(p + "rope.scaling.factor")))
    dim = field(p + "attention.key_length") or field(p + "rope.dimension_count") or hidden // n_heads

    def tok_id(key):
        v = field("tokenizer.ggml." + key)
        return int(v) if v is not None else None

    return dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_hidden_layers=required("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=int(field(p + "attention.head_count_kv", n_heads)),
        head_dim=int(dim),
        max_position_embeddings=int(field(p + "context_length", 2048)),
        rms_norm_eps=float(field(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=tok_id("bos_token_id"),
        eos_token_id=tok_id("eos_token_id"),
        pad_token_id=tok_id("padding_token_id"),
    )
