"""Shared pieces of the speculative-decoding tests: tiny targets of each family, draft models of their vocabulary,
and EAGLE-3 heads with random weights written in the published checkpoint format (config.json + model.safetensors,
EAGLE's tensor names)."""

import json
import os

import torch
import transformers

from polyfuse.generation.hooks import GenerationHooks
from polyfuse.models import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=7,
    tie_word_embeddings=False, initializer_range=0.2,
)  # fmt: skip
FAMILIES = {
    "llama": (transformers.LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, MistralForCausalLM, {"sliding_window": 12}),
    "qwen2": (transformers.Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
}


def tiny(family: str = "llama", seed: int = 0, **overrides):
    """A random target (or draft: fewer layers in ``overrides``) of ``family``, fp32 on the CPU."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    cfg = cfg_cls(**{**COMMON, **extra, **overrides})
    return model_cls.from_config(cfg, seed=seed).eval()


def write_eagle3(path, target, seed: int = 0, draft_vocab: int = 96, layer_ids=None, hidden=None, std=0.1) -> str:
    """EAGLE-3 heads with random weights for ``target`` in the published format: a Llama config with
    ``draft_vocab_size`` (and ``eagle_config``'s layer ids when given), tensors under EAGLE's names, ``d2t`` mapping
    draft ids to the target ids given by a random subset, ``t2d`` its mask."""
    from safetensors.torch import save_file

    cfg = target.config
    h, t = hidden or cfg.hidden_size, cfg.hidden_size
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, h // cfg.num_attention_heads
    inter = cfg.intermediate_size
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(shape, generator=gen) * std

    hot = torch.randperm(cfg.vocab_size, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    tensors = {
        "fc.weight": rnd(h, 3 * t),
        "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rnd(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": rnd(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": rnd(inter, h),
        "midlayer.mlp.up_proj.weight": rnd(inter, h),
        "midlayer.mlp.down_proj.weight": rnd(h, inter),
        "midlayer.input_layernorm.weight": 1 + rnd(h),
        "midlayer.hidden_norm.weight": 1 + rnd(h),
        "midlayer.post_attention_layernorm.weight": 1 + rnd(h),
        "norm.weight": 1 + rnd(h),
        "lm_head.weight": rnd(draft_vocab, h) * 10,
        "d2t": hot - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    }  # fmt: skip
    if hidden is not None:
        config["target_hidden_size"] = t
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


class SpecStats(GenerationHooks):
    """Hooks that keep the last call's SpeculationStats (None when the call did not speculate)."""

    stats = None

    def speculation(self, stats):
        self.stats = stats
