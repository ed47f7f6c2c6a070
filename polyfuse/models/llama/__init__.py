"""Llama on polyfuse ops: model, checkpoint loading (safetensors, GGUF), static KV cache, generation."""

from polyfuse.models.llama import loading
from polyfuse.models.llama.config import CheckpointError
from polyfuse.models.llama.model import CausalLMOutput, LlamaForCausalLM


LlamaForCausalLM.from_pretrained = staticmethod(loading.from_pretrained)
LlamaForCausalLM.from_config = staticmethod(loading.from_config)

__all__ = ["CausalLMOutput", "CheckpointError", "LlamaForCausalLM"]
