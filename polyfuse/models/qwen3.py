"""Qwen3: Llama's layers with a per-head RMSNorm of queries and keys before rotary (the ``qk_norm`` op, so a
backend can fuse it), an explicit head_dim, and sliding windows where ``layer_types`` says."""

from transformers import Qwen3Config

from polyfuse.models.decoder import Attention, DecoderForCausalLM, RMSNorm


class Qwen3Attention(Attention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def heads(self, x, f, qkv=None):
        q, k, v = super().heads(x, f, qkv)
        q, k = f.ops.qk_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return q, k, v


class Qwen3ForCausalLM(DecoderForCausalLM):
    config_class = Qwen3Config
    model_types = ("qwen3",)
    hf_architecture = "Qwen3ForCausalLM"
    attention_cls = Qwen3Attention
