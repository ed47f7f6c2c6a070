"""Mistral: Llama's layers with sliding-window attention (``config.sliding_window``, every layer); the window is
part of each layer's AttentionMeta, which every attention implementation honours (native, SDPA, the Triton
decode kernel, Gaudi's FusedSDPA through its masked path)."""

from transformers import MistralConfig

from polyfuse.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    config_class = MistralConfig
    model_types = ("mistral",)
    hf_architecture = "MistralForCausalLM"
