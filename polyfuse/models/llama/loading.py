"""Build a polyfuse Llama: config -> modules on the meta device -> storage in the target dtype and device ->
weights copied in one tensor at a time (no random init, no second full copy) -> kernels resolved by the registry."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from polyfuse.backends.registry import SelectionContext, resolve
from polyfuse.backends.runtime import get_runtime
from polyfuse.models.llama.config import CheckpointError, config_from_folder, config_from_gguf
from polyfuse.models.llama.model import LlamaForCausalLM
from polyfuse.models.llama.weights import iter_gguf, iter_safetensors, open_gguf


# Fused parameter fragment -> the HF fragments stacked in it along dim 0, in order.
_FUSED = {
    "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
}

# Threads reading safetensors tensors and copying them to the device concurrently.
LOAD_WORKERS = min(8, os.cpu_count() or 1)

ATTENTION_OPTION_FLAGS = {
    "causal_prefill": "flash_attention_causal_mask",
    "recompute": "flash_attention_recompute",
    "fast_softmax": "flash_attention_fast_softmax",
    "softmax_bf16": "attn_softmax_bf16",
}


def _part_sizes(config, fused: str) -> list[int]:
    if fused.endswith("qkv_proj"):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv = config.num_key_value_heads * head_dim
        return [config.num_attention_heads * head_dim, kv, kv]
    return [config.intermediate_size, config.intermediate_size]


def _target(config, hf_name: str) -> tuple[str, Optional[slice]]:
    """HF parameter name -> (polyfuse parameter name, row slice inside it or None)."""
    for fused, parts in _FUSED.items():
        for idx, frag in enumerate(parts):
            if f".{frag}." in hf_name:
                sizes = _part_sizes(config, fused)
                start = sum(sizes[:idx])
                return hf_name.replace(frag, fused), slice(start, start + sizes[idx])
    return hf_name, None


def build(config, dtype=torch.float32, device="cpu", flags=None, overrides="", training=False) -> LlamaForCausalLM:
    """Empty model (uninitialized storage) on ``device`` in ``dtype``, with kernels resolved."""
    device = torch.device(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.init_frequencies(device)
    model.train(training)
    set_kernels(model, flags or {}, overrides, training)
    return model


def set_kernels(model: LlamaForCausalLM, flags: dict, overrides: str = "", training: bool = False):
    ctx = SelectionContext(model.device, model.dtype, dict(flags), training, overrides)
    model.kernels = resolve(ctx)
    model.runtime = get_runtime(model.device)
    model.flags = dict(flags)
    model.attention_options = {k: bool(flags.get(f)) for k, f in ATTENTION_OPTION_FLAGS.items()}
    if model.device.type != "hpu":
        model.attention_options["softmax_bf16"] = False  # a Gaudi option (check_flags warns about it elsewhere)
    if flags.get("torch_compile"):
        model.kernels = model.kernels.compiled()
    return model.kernels


def load_weights(model: LlamaForCausalLM, tensors, workers: int = 1) -> None:
    """Copy (HF name, tensor) pairs into the model's parameters. A tensor may be a zero-argument callable that reads
    it: with ``workers`` > 1 the reads and the host-to-device copies of different tensors then overlap."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.config.tie_word_embeddings

    def place(item) -> Optional[str]:
        hf_name, tensor = item
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if tied and hf_name == "lm_head.weight":
            hf_name = "model.embed_tokens.weight"
        name, rows = _target(model.config, hf_name)
        param = params.get(name)
        if param is None:
            raise CheckpointError(f"unexpected weight {hf_name!r} for a Llama checkpoint")
        if callable(tensor):
            tensor = tensor()
        dst = param.data if rows is None else param.data[rows]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise CheckpointError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        return hf_name

    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            seen = set(pool.map(place, tensors))
    else:
        seen = {place(item) for item in tensors}
    missing = sorted(set(expected_hf_names(model)) - seen)
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[0]!r}")


def expected_hf_names(model: LlamaForCausalLM) -> list[str]:
    return [n for n, _ in hf_state_items(model)]


def hf_state_items(model: LlamaForCausalLM):
    """(HF name, tensor view) for every weight, splitting the fused projections back."""
    for name, param in model.named_parameters():
        fused = next(((f, parts) for f, parts in _FUSED.items() if f".{f}." in name), None)
        if fused is None:
            yield name, param.data
            continue
        frag, parts = fused
        sizes = _part_sizes(model.config, frag)
        for part, chunk in zip(parts, param.data.split(sizes, dim=0)):
            yield name.replace(frag, part), chunk


def _dtype_of(dtype):
    if isinstance(dtype, str):
        dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return dtype


def from_pretrained(
    path: str,
    gguf_file: Optional[str] = None,
    dtype=torch.float32,
    device="cpu",
    flags: Optional[dict] = None,
    overrides: str = "",
    training: bool = False,
) -> LlamaForCausalLM:
    t0 = time.perf_counter()
    dtype = _dtype_of(dtype) or torch.float32
    if gguf_file is not None:
        file = gguf_file if os.path.isabs(gguf_file) or path is None else os.path.join(path, gguf_file)
        reader = open_gguf(file)
        config = config_from_gguf(reader, file)
        tensors = iter_gguf(reader, config)
    else:
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such checkpoint folder")
        config = config_from_folder(path)
        tensors = iter_safetensors(path)
    model = build(config, dtype, device, flags, overrides, training)
    with torch.no_grad():
        load_weights(model, tensors, workers=1 if gguf_file is not None else LOAD_WORKERS)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    model.load_seconds = time.perf_counter() - t0
    return model


def from_config(config, dtype=torch.float32, device="cpu", flags=None, overrides="", training=False, seed=0):
    """Random weights in the given shape (HF's init: normal(0, initializer_range), norms at one)."""
    model = build(config, _dtype_of(dtype) or torch.float32, device, flags, overrides, training)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
    return model


def save_pretrained(model: LlamaForCausalLM, path: str, max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json + safetensors (sharded above ``max_shard_bytes``) that transformers loads as is."""
    import json

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = model.config
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = model.dtype
    config.save_pretrained(path)
    shards, current, size = [], {}, 0
    for name, t in hf_state_items(model):
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if current and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t.detach().contiguous().cpu()
        size += t.numel() * t.element_size()
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
