"""The few differences polyfuse meets between transformers 4.55 (what Gaudi's optimum-habana 1.21 pins) and 5.x, in
one place: rotary settings (5.x: ``config.rope_parameters``; 4.x: ``rope_theta`` + ``rope_scaling``) and the
weights' dtype keyword (``dtype`` from 4.56 on, ``torch_dtype`` before). Everything above ``polyfuse.core`` that
must tell the versions apart asks this module; core never imports it."""

from __future__ import annotations

import transformers
from packaging.version import Version


TRANSFORMERS_VERSION = Version(transformers.__version__)
TRANSFORMERS_5 = TRANSFORMERS_VERSION.major >= 5
# from_pretrained / from_config keyword, and config attribute, for the weights' dtype.
DTYPE_KW = "dtype" if TRANSFORMERS_VERSION >= Version("4.56") else "torch_dtype"


def rope_parameters(config) -> dict:
    """transformers 5's ``config.rope_parameters`` (rope_type, rope_theta, factor, ...) under any version. On 4.x it
    is built from ``rope_scaling`` (None for default RoPE; older files say ``type``) and ``rope_theta``."""
    if TRANSFORMERS_5:
        return getattr(config, "rope_parameters", None) or {}
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if getattr(config, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    return params


def config_kwargs(kw: dict) -> dict:
    """Config fields (keyword arguments or a config.json dict) that may use 5.x's ``rope_parameters``, as the
    installed transformers takes them. A 4.x config given ``rope_parameters`` stores it as an unknown attribute and
    keeps rope_theta 10000 without a word, so on 4.x it becomes ``rope_theta`` plus ``rope_scaling`` (None for
    default RoPE). 5.x reads the old fields itself; nothing changes there."""
    if TRANSFORMERS_5 or not isinstance(kw.get("rope_parameters"), dict):
        return kw
    kw = dict(kw)
    rope = dict(kw.pop("rope_parameters"))
    kw["rope_theta"] = rope.pop("rope_theta", kw.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in rope:
        kw.setdefault("partial_rotary_factor", rope.pop("partial_rotary_factor"))
    kw["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    return kw


def make_config(config_class, **kw):
    """``config_class(**kw)`` (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, ...) on any transformers."""
    return config_class(**config_kwargs(kw))


def llama_config(**kw):
    return make_config(transformers.LlamaConfig, **kw)


def set_config_dtype(config, dtype) -> None:
    """Record the weights' dtype in a config the way the installed transformers writes it to config.json."""
    setattr(config, DTYPE_KW, dtype)


# A causal LM's tied head in the form the installed PreTrainedModel reads (5.x: {target: source}; 4.x: targets).
TIED_LM_HEAD = {"lm_head.weight": "model.embed_tokens.weight"} if TRANSFORMERS_5 else ["lm_head.weight"]
