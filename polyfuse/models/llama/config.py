"""Llama configuration: transformers' ``LlamaConfig`` (same fields, so checkpoints go both ways), read from a
checkpoint folder's config.json or from a GGUF file's metadata, and checked to be a Llama."""

from __future__ import annotations

import json
import os

from transformers import LlamaConfig


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupt, or not a Llama. The message is one line."""


LLAMA_MODEL_TYPES = ("llama",)


def one_line(e) -> str:
    return " ".join(str(e).split())


def config_from_folder(path: str) -> LlamaConfig:
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
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type not in LLAMA_MODEL_TYPES:
        raise CheckpointError(
            f"{path}: architecture {model_type or archs or 'unknown'!s} is not supported; polyfuse runs Llama models"
        )
    try:
        return LlamaConfig.from_dict(raw)
    except Exception as e:  # transformers validates rope parameters and sizes
        raise CheckpointError(f"{cfg_path}: invalid Llama config ({one_line(e)})") from None


def config_from_gguf(reader, path: str) -> LlamaConfig:
    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return value

    arch = field("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; polyfuse runs Llama models")
    p = "llama."

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
    scaling_type = field(p + "rope.scaling.type")
    if scaling_type == "linear":
        rope.update(rope_type="linear", factor=float(field(p + "rope.scaling.factor")))
    head_dim = int(field(p + "rope.dimension_count", hidden // n_heads))

    def tok_id(key):
        v = field("tokenizer.ggml." + key)
        return int(v) if v is not None else None

    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_hidden_layers=required("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=int(field(p + "attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(field(p + "context_length", 2048)),
        rms_norm_eps=float(field(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=tok_id("bos_token_id"),
        eos_token_id=tok_id("eos_token_id"),
        pad_token_id=tok_id("padding_token_id"),
    )
