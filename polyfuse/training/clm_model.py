"""The model and tokenizer of examples/run_clm.py and examples/run_lora_clm.py: a local folder or .gguf file (the
built-in SmolLM2-135M-Instruct GGUF when none is given), or random weights in a config (``--config_name``,
``--model_type``, ``--config_overrides``), on transformers' Llama (patched by PolyfuseTrainer) or polyfuse's
(``--model_impl polyfuse``). Failures are one ValueError line."""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_source(model) -> None:
    """Parse-time checks of ModelSource: local paths only (nothing is downloaded), a known --model_impl."""
    if model.model_impl not in ("transformers", "polyfuse"):
        raise ValueError(f"--model_impl must be 'transformers' or 'polyfuse', got {model.model_impl!r}")
    if model.model_revision != "main":
        raise ValueError(f"--model_revision {model.model_revision}: only main (local files, nothing is downloaded)")
    path = model.model_name_or_path
    if path is not None and not os.path.isdir(path) and not (path.endswith(".gguf") and os.path.isfile(path)):
        raise ValueError(f"--model_name_or_path {path!r} is not a local folder or .gguf file (no hub downloads)")
    for name in ("config_name", "tokenizer_name"):
        value = getattr(model, name)
        if value is not None and not os.path.exists(value):
            raise ValueError(f"--{name} {value!r} is not a local folder or file (no hub downloads)")


def checkpoint_of(model) -> tuple:
    """(folder, GGUF file or None, name to record as the base model): the built-in model (recorded as the Hub model
    its GGUF was made from, which peft's AutoPeftModelForCausalLM can load), a folder (a folder holding exactly
    one .gguf and no config.json is that GGUF) or a .gguf file."""
    from polyfuse.loader.load import checkpoint_source
    from polyfuse.models.builtin import BUILTIN_HUB_ID, builtin_model

    path, gguf = model.model_name_or_path, model.gguf_file
    if path is None:
        try:
            path, gguf = builtin_model()
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        return path, gguf, BUILTIN_HUB_ID
    path, gguf = checkpoint_source(path, gguf)
    with contextlib.suppress(FileNotFoundError):
        folder, name = builtin_model()
        if gguf is not None and (os.path.realpath(path), gguf) == (os.path.realpath(folder), name):
            return path, gguf, BUILTIN_HUB_ID  # the built-in model given by its path
    return path, gguf, os.path.abspath(os.path.join(path, gguf) if gguf else path)


def parse_overrides(text: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"--config_overrides entry {item!r} is not key=value")
        k, v = (s.strip() for s in item.split("=", 1))
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                continue
        else:
            v = {"true": True, "false": False}.get(v.lower(), v)
        out[k] = v
    return out


@contextlib.contextmanager
def rope_checked(config):
    """transformers' models look the rope type up in ROPE_INIT_FUNCTIONS when built: an unknown one is a bare
    KeyError. Turn it into polyfuse's one-line ValueError naming the known types (``config``: a config, or a
    callable loading it, called only then)."""
    try:
        yield
    except KeyError:
        from polyfuse.models.rope import check_rope_type

        check_rope_type(config() if callable(config) else config)
        raise


def _scratch_config(model, path: str, kw: dict):
    """The config random weights are drawn in, or None for a pretrained model: --config_name, --model_type, or the
    model's own with --config_overrides."""
    from transformers import AutoConfig

    if model.config_name is not None:
        config = AutoConfig.from_pretrained(model.config_name)
    elif getattr(model, "model_type", None) and model.model_name_or_path is None:
        try:
            config = AutoConfig.for_model(model.model_type)
        except ValueError:
            raise ValueError(f"--model_type {model.model_type!r}: not a transformers model type") from None
    elif getattr(model, "config_overrides", None):
        config = AutoConfig.from_pretrained(path, **kw)
    else:
        return None
    for k, v in parse_overrides(getattr(model, "config_overrides", None) or "").items():
        if not hasattr(config, k):
            raise ValueError(f"--config_overrides: {type(config).__name__} has no field {k!r}")
        setattr(config, k, v)
    return config


def _dtype(requested: Optional[str], config) -> torch.dtype:
    """--torch_dtype; None / auto: the checkpoint's (its config's dtype), float32 where it names none."""
    if requested in DTYPES:
        return DTYPES[requested]
    saved = getattr(config, "dtype", None)
    if saved is None and not hasattr(type(config), "dtype"):  # transformers 4.x names it torch_dtype (5.x warns)
        saved = getattr(config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = DTYPES.get(saved)
    return saved if saved in DTYPES.values() else torch.float32


def _tokenizer(model, path: str, kw: dict, extra: dict):
    from transformers import AutoTokenizer

    extra = {**extra, **({"use_fast": False} if not model.use_fast_tokenizer else {})}
    if model.tokenizer_name:
        return AutoTokenizer.from_pretrained(model.tokenizer_name, **extra)
    return AutoTokenizer.from_pretrained(path, **kw, **extra)


def load_model_and_tokenizer(model, targs, dtype_name: Optional[str] = None, tokenizer_kwargs: Optional[dict] = None):
    """(model, tokenizer). ``dtype_name``: run_clm.py's --torch_dtype; run_lora_clm.py passes bfloat16 with --bf16
    (and float32 without, as its from_pretrained does) and ``padding_side="right"`` for the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from polyfuse.compat import DTYPE_KW  # dtype= from transformers 4.56 on, torch_dtype= before

    path, gguf, _ = checkpoint_of(model)
    kw = {"gguf_file": gguf} if gguf else {}
    tokenizer = _tokenizer(model, path, kw, tokenizer_kwargs or {})
    config = _scratch_config(model, path, kw)
    use_cache = False if targs.gradient_checkpointing else model.use_cache
    polyfuse_kw = dict(device=targs.device, flags=targs.polyfuse_flags(), overrides=targs.polyfuse_overrides(),
                       training=True)  # fmt: skip
    if config is not None:
        config.use_cache = use_cache
        dtype = DTYPES.get(dtype_name, torch.float32)  # random weights: float32 unless asked
        if model.model_impl == "polyfuse":
            from polyfuse.models import AutoModelForCausalLM as PolyfuseAuto

            return PolyfuseAuto.from_config(config, dtype=dtype, **polyfuse_kw), tokenizer
        from transformers import set_seed

        set_seed(targs.seed)  # the same random weights on every rank (FSDP2 shards each rank's own copy)
        with rope_checked(config):
            return AutoModelForCausalLM.from_config(config, **{DTYPE_KW: dtype}), tokenizer
    with rope_checked(lambda: AutoConfig.from_pretrained(path, **kw)):
        config = AutoConfig.from_pretrained(path, **kw)
    dtype = _dtype(dtype_name, config)
    if model.model_impl == "polyfuse":
        from polyfuse.models import AutoModelForCausalLM as PolyfuseAuto

        return PolyfuseAuto.from_pretrained(path, gguf_file=gguf, dtype=dtype, **polyfuse_kw), tokenizer
    extra = {"low_cpu_mem_usage": True} if getattr(model, "low_cpu_mem_usage", False) and _transformers4() else {}
    with rope_checked(config):
        loaded = AutoModelForCausalLM.from_pretrained(path, **{DTYPE_KW: dtype}, **kw, **extra)
    loaded.config.use_cache = use_cache
    if gguf:
        # transformers dequantizes GGUF weights into ordinary parameters but still tags the model as quantized,
        # which Trainer refuses to fine-tune; nothing is quantized any more, so drop the tag (and from the config,
        # so the saved checkpoint is a plain one).
        loaded.hf_quantizer = None
        if "is_quantized" in vars(loaded):
            loaded.is_quantized = False
        if hasattr(loaded.config, "quantization_config"):
            del loaded.config.quantization_config
    return loaded, tokenizer


def _transformers4() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5


def resize_embeddings(model, tokenizer) -> None:
    """A tokenizer with more tokens than the model's embedding: the embedding grows (optimum-habana's run_clm.py)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and len(tokenizer) > emb.weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
