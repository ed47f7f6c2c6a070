"""Qwen2 / Qwen2.5: Llama's layers with q/k/v projection biases (always on; o_proj has none), and sliding windows
on the layers ``layer_types`` marks when ``use_sliding_window`` is set."""

from transformers import Qwen2Config

from polyfuse.models.decoder import Attention, DecoderForCausalLM


class Qwen2Attention(Attention):
    qkv_bias_default = True


class Qwen2ForCausalLM(DecoderForCausalLM):
    config_class = Qwen2Config
    model_types = ("qwen2",)
    hf_architecture = "Qwen2ForCausalLM"
    attention_cls = Qwen2Attention
