"""Loading EAGLE-3 heads in their published format: a folder with ``config.json`` (a Llama config with
``draft_vocab_size``, optionally ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
``model.safetensors`` (or ``pytorch_model.bin``), as EAGLE's own training writes them and SGLang / vLLM read them:

    fc.weight [H, 3 x target H]        midlayer.self_attn.{q,k,v,o}_proj.weight   midlayer.mlp.{gate,up,down}_proj.weight
    midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight        norm.weight
    lm_head.weight [draft vocab, H]    d2t [draft vocab] (target id - draft id)    t2d [vocab] (bool, not needed)
    embed_tokens.weight (optional: the target's embedding otherwise)

Names with a ``model.`` prefix or ``layers.0.`` for ``midlayer.`` (converted checkpoints) are read the same.
"""

from __future__ import annotations

import glob
import os

import torch
import transformers

from polyfuse.checkpoint.config import config_from_dict, read_config_dict
from polyfuse.checkpoint.readers import iter_safetensors
from polyfuse.core.errors import CheckpointError, one_line
from polyfuse.distributed.context import SINGLE
from polyfuse.loader.load import build
from polyfuse.models.decoder import DecoderForCausalLM
from polyfuse.models.eagle3 import Eagle3Head


FUSED = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
         "self_attn.v_proj": ("self_attn.qkv_proj", 2), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
         "mlp.up_proj": ("mlp.gate_up_proj", 1)}  # fmt: skip
REQUIRED = ("fc.weight", "norm.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight")


def _name(key: str) -> str:
    key = key[len("model.") :] if key.startswith("model.") else key
    return "midlayer." + key[len("layers.0.") :] if key.startswith("layers.0.") else key


def read_tensors(path: str) -> dict:
    """{normalized name: zero-argument reader} of the head's weights."""
    if glob.glob(os.path.join(path, "*.safetensors")) or os.path.isfile(
        os.path.join(path, "model.safetensors.index.json")
    ):
        return {_name(k): r for k, r in iter_safetensors(path)}
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not bins:
        raise CheckpointError(f"{path}: no model.safetensors or pytorch_model.bin")
    out = {}
    for file in bins:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read it ({one_line(e)})") from None
        out.update({_name(k): (lambda t=t: t) for k, t in state.items()})
    return out


def eagle3_config(path: str, target, names) -> object:
    """The head's config, checked against ``target``: one-line ValueErrors for heads that cannot draft for it."""
    missing = [n for n in REQUIRED if n not in names]
    if missing:
        raise CheckpointError(f"{path}: not an EAGLE-3 checkpoint (no {', '.join(missing)})")
    raw = dict(read_config_dict(path))
    raw["model_type"] = "llama"  # EAGLE-3 heads are Llama layers whatever the target's family
    config = config_from_dict(transformers.LlamaConfig, raw, f"{path}/config.json")
    ours = target.config
    theirs = getattr(config, "target_hidden_size", None) or config.hidden_size
    if theirs != ours.hidden_size:
        raise ValueError(
            f"EAGLE-3 heads {path} read hidden states of size {theirs}; the model's hidden size is {ours.hidden_size}"
        )
    if config.vocab_size != ours.vocab_size:
        raise ValueError(f"EAGLE-3 heads {path} map drafts into a vocabulary of {config.vocab_size} tokens; the "
                         f"model's has {ours.vocab_size}")  # fmt: skip
    if config.num_hidden_layers != 1:
        raise ValueError(f"EAGLE-3 heads {path} have {config.num_hidden_layers} layers; polyfuse runs one-layer heads")
    config.eagle_own_embedding = "embed_tokens.weight" in names
    config.eagle_own_head = "lm_head.weight" in names
    config.eagle_fc_bias = "fc.bias" in names
    if not config.eagle_own_embedding and config.hidden_size != ours.hidden_size:
        raise ValueError(f"EAGLE-3 heads {path} of hidden size {config.hidden_size} need their own embed_tokens "
                         f"(the model's embedding is {ours.hidden_size} wide)")  # fmt: skip
    draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
    if not config.eagle_own_head and draft_vocab != ours.vocab_size:
        raise CheckpointError(f"{path}: no lm_head.weight for its draft vocabulary of {draft_vocab}")
    return config


def _copy(head: Eagle3Head, names: dict, path: str) -> None:
    params = dict(head.named_parameters())
    params["d2t"] = head.d2t
    sizes = {"self_attn.qkv_proj": [head.midlayer.self_attn.q_size, *[head.midlayer.self_attn.kv_size] * 2],
             "mlp.gate_up_proj": [head.midlayer.mlp.inter] * 2}  # fmt: skip
    for name, read in names.items():
        if name == "t2d":
            continue
        target, rows = name, None
        for part, (fused, i) in FUSED.items():
            if name.startswith(f"midlayer.{part}."):
                target = name.replace(part, fused)
                start = sum(sizes[fused][:i])
                rows = slice(start, start + sizes[fused][i])
        dst = params.get(target)
        if dst is None:
            raise CheckpointError(f"{path}: unexpected tensor {name} for an EAGLE-3 head")
        dst = dst if rows is None else dst[rows]
        t = read()
        if tuple(t.shape) != tuple(dst.shape):
            raise CheckpointError(f"{path}: {name} has shape {tuple(t.shape)}, the head expects {tuple(dst.shape)}")
        dst.copy_(t)


def load_eagle3(path: str, target, overrides: str = "") -> Eagle3Head:
    """The EAGLE-3 head at ``path`` (a folder) for ``target``: in its dtype, on its device, with its flags."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such EAGLE-3 checkpoint folder")
    names = read_tensors(path)
    config = eagle3_config(path, target, names)
    head = build(Eagle3Head, config, target.dtype, target.device, target.flags, overrides, tp=SINGLE)  # one device
    head.positions = max(config.max_position_embeddings, target.config.max_position_embeddings)
    head.init_buffers(target.device)
    with torch.no_grad():
        _copy(head, names, path)
    head.share(target)
    head.eval()
    head.name_or_path = str(path)
    return head


def speculative_model_for(target, path: str, method=None):
    """``model.generate(speculative_model=PATH)``: EAGLE-3 heads at ``path`` (a draft model with
    ``method="draft"``), loaded for ``target`` on first use and kept on it."""
    loaded = target.__dict__.setdefault("_speculative_models", {})
    key = (path, method == "draft")
    if key not in loaded:
        if method == "draft":
            from polyfuse.models.auto import AutoModelForCausalLM

            draft = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype, device=target.device,
                                                         flags=target.flags)  # fmt: skip
            loaded[key] = draft.eval()
        else:
            loaded[key] = load_eagle3(path, target)
    return loaded[key]


DecoderForCausalLM.speculative_loader = staticmethod(speculative_model_for)
