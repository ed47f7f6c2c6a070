"""Checkpoint files: safetensors folders (sharded or not) and GGUF files read one tensor at a time, config.json /
GGUF metadata, a rank's shard of a tensor, and tokenizers. Knows nothing of models or quantization."""
