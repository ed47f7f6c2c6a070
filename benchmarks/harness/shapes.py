"""Real model shapes for random-weight benchmarks (no downloads)."""

from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from polyfuse.compat import make_config


CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "llama2-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama2-13b": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # Llama-2-70B whole (80 layers, 69B parameters: 138 GB in bf16): tensor parallel only (--tp 2 and up), with random
    # weights drawn per shard on each device.
    "llama2-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # One decoder block of Llama-2-70B (tokens/s per block, as Petals reports); a tiny vocab keeps the head out.
    "llama2-70b-block": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=1,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128,
        max_position_embeddings=4096,
    ),
    "llama3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "mistral-7b": dict(
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
        sliding_window=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=2048,
    ),
    # tiny with enough layers for EAGLE-3's three feature layers (benchmark_speculative.py's CPU smoke)
    "tiny8": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=2048,
    ),
}


def config_for(name: str):
    """The transformers config of a named shape (Llama unless the shape says otherwise)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    kw = dict(SHAPES[name])
    kw.setdefault("tie_word_embeddings", False)
    return make_config(CONFIGS[kw.pop("model_type", "llama")], **kw)  # rope_parameters on transformers 4.x too
