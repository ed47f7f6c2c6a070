"""Llama (Llama 2/3, SmolLM, TinyLlama, ...): the shared decoder as is."""

from transformers import LlamaConfig

from polyfuse.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    config_class = LlamaConfig
    model_types = ("llama",)
    hf_architecture = "LlamaForCausalLM"
