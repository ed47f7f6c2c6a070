"""--peft_model PATH: a PEFT adapter (a folder, or a Hub id read from the cache when offline) loaded onto the model
and merged into its weights before generation, as optimum-habana's run_generation.py does (``merge_and_unload``):
the run then costs what the bare model costs.

The base, as optimum-habana picks it: the model the adapter records (``base_model_name_or_path``) where it is a
local folder or a Hub model that can be read; else --model_name_or_path (or, without it, the built-in model) with a
warning. An adapter trained on the built-in model records the Hub model its GGUF was made from; without that model
in the cache, the built-in is its base (no warning). The weights load in float (a GGUF's dequantized): --quant and
tensor parallelism are refused, since the adapter's deltas are added to whole float weights.
"""

from __future__ import annotations

import sys
from typing import Callable

from polyfuse.cli.errors import UsageError


def _peft():
    try:
        import peft
    except ImportError:
        raise UsageError("--peft_model needs the peft package: pip install peft") from None
    return peft


def adapter_base(path: str):
    """The base model the adapter at ``path`` records (None when it records none)."""
    peft = _peft()
    try:
        config = peft.PeftConfig.from_pretrained(path)
    except Exception as e:  # no such folder, no adapter_config.json, not in the cache, ...
        raise UsageError(f"--peft_model {path}: not a PEFT adapter folder or Hub id in reach ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None  # fmt: skip
    return getattr(config, "base_model_name_or_path", None)


def choose_base(args, resolvable: Callable[[str], bool]) -> None:
    """Check what cannot go with --peft_model and set ``args.model_name_or_path`` to the base to load."""
    from polyfuse.distributed.context import world_size_from_env
    from polyfuse.models.builtin import BUILTIN_HUB_ID, BUILTIN_NAME

    if getattr(args, "quant", None) not in (None, "none"):
        raise UsageError(f"--peft_model with --quant {args.quant}: the adapter merges into float weights; merge it, "
                         "save the merged model, then quantize that")  # fmt: skip
    if world_size_from_env() > 1:
        raise UsageError("--peft_model: the adapter merges on one device, not under tensor parallelism; merge it and "
                         "save_pretrained on one device, then load that checkpoint sharded")  # fmt: skip
    base, given = adapter_base(args.peft_model), args.model_name_or_path
    if base and base != given and resolvable(base):
        if given is not None:
            print(f"warning: --peft_model: loading the adapter's base {base}, not --model_name_or_path {given} (as "
                  "optimum-habana does)", file=sys.stderr)  # fmt: skip
        args.model_name_or_path, args.gguf_file = base, None
        return
    if not base or base == given or (base == BUILTIN_HUB_ID and given is None):
        return
    fallback = f"--model_name_or_path {given}" if given is not None else f"the built-in {BUILTIN_NAME}"
    print(f"warning: --peft_model: the adapter's base {base} is neither a local folder nor a Hub model in reach: "
          f"loading {fallback} as its base (as optimum-habana falls back)", file=sys.stderr)  # fmt: skip


def merge_adapter(model, path: str):
    """``model`` with the adapter at ``path`` merged into its weights (the same model object, unwrapped)."""
    peft = _peft()
    try:
        wrapped = peft.PeftModel.from_pretrained(model, path)
    except Exception as e:  # modules the model lacks, shapes of another model, ...
        raise UsageError(f"--peft_model {path}: cannot load it onto this model ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None  # fmt: skip
    if not hasattr(wrapped, "merge_and_unload"):
        raise UsageError(f"--peft_model {path}: a {wrapped.peft_type} adapter, which PEFT cannot merge into the "
                         "weights; only mergeable adapters (LoRA and its kin) are supported")  # fmt: skip
    try:
        merged = wrapped.merge_and_unload()
    except Exception as e:
        raise UsageError(f"--peft_model {path}: merging failed ({type(e).__name__}: {e})") from None
    return merged.eval()
