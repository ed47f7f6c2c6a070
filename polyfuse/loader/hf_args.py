"""transformers' ``from_pretrained`` keywords in polyfuse's terms: ``dtype`` / ``torch_dtype`` (``"auto"``: the
checkpoint's), ``device_map`` (one device: polyfuse does not split a model over devices), the Hub's ``revision``,
``subfolder``, ``token``, ``cache_dir``, ``local_files_only``, a ``config`` object, and config attributes as keywords
(transformers updates the config with them). A keyword polyfuse cannot honour is refused, never dropped."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch


logger = logging.getLogger("polyfuse")

HUB_KEYS = ("revision", "subfolder", "token", "cache_dir", "local_files_only")
# Keywords that change nothing polyfuse does: bookkeeping of the caller (pipeline, Auto classes), or a choice
# polyfuse always makes its own way (meta-device build; attention picked by the op registry; no remote code run).
NO_EFFECT = frozenset(
    {"_from_pipeline", "_from_auto", "_commit_hash", "trust_remote_code", "low_cpu_mem_usage", "code_revision",
     "force_download", "proxies", "resume_download", "user_agent"}
)  # fmt: skip
# Keywords with the values polyfuse honours (any other would change the result without a word).
ONLY = {"output_loading_info": (False,), "ignore_mismatched_sizes": (False,), "quantization_config": (None,),
        "use_kernels": (False,), "tp_plan": (None,), "offload_folder": (None,), "variant": (None,),
        "key_mapping": (None,), "use_safetensors": (None, True)}  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadRequest:
    dtype: object = None  # a torch.dtype, a name, "auto", or None (polyfuse's default, float32)
    device: object = None
    hub: dict = field(default_factory=dict)
    config: object = None  # a transformers config object to use instead of the checkpoint's
    config_updates: dict = field(default_factory=dict)  # the remaining keywords: config attributes


def load_request(dtype, device, kwargs: dict) -> LoadRequest:
    """Split transformers' ``from_pretrained`` keywords into what the loader takes."""
    kwargs = dict(kwargs)
    req = LoadRequest(hub={k: kwargs.pop(k) for k in HUB_KEYS if k in kwargs})
    torch_dtype = kwargs.pop("torch_dtype", None)
    req.dtype = dtype if dtype is not None else torch_dtype
    req.device = device_from_map(kwargs.pop("device_map", None), device)
    req.config = kwargs.pop("config", None)
    for key, allowed in ONLY.items():
        if key in kwargs and kwargs[key] not in allowed:
            raise ValueError(f"from_pretrained({key}={kwargs[key]!r}) is not supported by polyfuse's models")
        kwargs.pop(key, None)
    adapter = kwargs.pop("adapter_kwargs", None) or {}  # the Auto classes' PEFT lookup: a path when it found one
    if adapter.get("_adapter_model_path"):
        raise ValueError(
            f"{adapter['_adapter_model_path']} is a PEFT adapter: load its base model with polyfuse, then the "
            "adapter with peft.PeftModel.from_pretrained(model, path)"
        )
    attn = kwargs.pop("attn_implementation", None)
    if attn is not None:
        logger.info("polyfuse: attn_implementation=%r: the op registry picks the attention kernel", attn)
    for key in NO_EFFECT:
        kwargs.pop(key, None)
    req.config_updates = kwargs
    return req


def device_from_map(device_map, device):
    """The one device ``device_map`` names (transformers' forms: "auto", a device, an index, {"": device}, a map
    whose entries all name one device)."""
    if device_map is None:
        return device if device is not None else "cpu"
    if isinstance(device_map, dict):
        places = {str(_device(v)) for v in device_map.values()}
        if len(places) != 1:
            raise ValueError(
                f"device_map places the model on {', '.join(sorted(places))}: polyfuse runs a model on one device "
                "(several GPUs: tensor parallelism, docs/distributed.md)"
            )
        target = _device(next(iter(device_map.values())))
    elif device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        from polyfuse.core.platform import default_device_type

        target = torch.device(default_device_type())
    else:
        target = _device(device_map)
    if device is not None and torch.device(device) != target:
        raise ValueError(f"device={device!r} and device_map={device_map!r} name different devices")
    return target


def _device(value) -> torch.device:
    if isinstance(value, int):
        from polyfuse.core.platform import default_device_type

        kind = default_device_type()
        return torch.device(kind, value) if kind != "cpu" else torch.device("cpu")
    if value in ("disk", "meta"):
        raise ValueError(f"device_map entry {value!r}: polyfuse keeps every weight on the device it runs on")
    return torch.device(value)


def resolve_dtype(dtype, raw: dict, gguf: bool) -> torch.dtype:
    """A torch dtype from ``dtype``: None -> float32; "auto" -> the checkpoint's (config.json's ``dtype`` /
    ``torch_dtype``; float32 for a GGUF or a config that names none), as transformers' ``dtype="auto"``."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (float32, bfloat16, float16 or auto)")
        return DTYPES[dtype]
    if dtype == "auto":
        named = None if gguf else (raw.get("dtype") or raw.get("torch_dtype"))
        return DTYPES.get(str(named).replace("torch.", ""), torch.float32)
    return dtype
