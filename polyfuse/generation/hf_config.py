"""The settings one ``generate()`` call runs with, by transformers' precedence (``GenerationMixin.generate`` in 4.55
and 5.x alike): keyword arguments, over the ``generation_config`` passed, over the model's ``generation_config``
(from the checkpoint's generation_config.json), over transformers' defaults (``top_k=50``, ...).

A config "sets" a field where it differs from a fresh ``GenerationConfig()`` (5.x: where it is not None; 4.55: where
it differs from the default), so a passed config falls back to the model's for every field it leaves alone. A
keyword given as None clears the field, as in transformers (``top_k=None``: no top-k). A field a config sets that
polyfuse does not implement is refused by name; bookkeeping and speed-only fields are not read.
"""

from __future__ import annotations

from typing import Optional


# Fields that do not change which tokens come out (bookkeeping, cache and compile choices: polyfuse keeps its own
# static cache and graphs), or only matter to a strategy that reads them itself (the assistant's, when one runs).
NOT_READ = frozenset(
    {"transformers_version", "_from_model_config", "bos_token_id", "decoder_start_token_id", "cache_implementation",
     "cache_config", "compile_config", "disable_compile", "prefill_chunk_size", "return_legacy_cache",
     "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
     "assistant_lookbehind", "target_lookbehind", "is_assistant", "assistant_early_exit", "max_matching_ngram_size"}
)  # fmt: skip
# transformers' defaults polyfuse starts from where nothing sets a field (max_length is left out: unset, it means
# 20 new tokens, as transformers' default does).
DEFAULTS_READ = ("top_k",)


def _fresh() -> dict:
    from transformers import GenerationConfig

    return GenerationConfig().to_dict()


def _global_defaults() -> dict:
    """transformers' own defaults: 5.x keeps them apart (a fresh config holds None), 4.x in the fresh config."""
    from transformers import GenerationConfig

    fresh = GenerationConfig()
    get = getattr(fresh, "_get_default_generation_params", None)
    return dict(get()) if get is not None else fresh.to_dict()


def set_fields(config, fresh: dict) -> dict:
    """The fields ``config`` sets (differs from a fresh GenerationConfig), custom entries left out."""
    if config is None:
        return {}
    return {k: v for k, v in config.to_dict().items() if k in fresh and v != fresh[k] and k not in NOT_READ}


def resolve(model_config, generation_config, kwargs: dict, supported) -> dict:
    """{field: value} for one call: transformers' defaults for ``DEFAULTS_READ``, then the fields the model's and the
    passed config set, then ``kwargs``. A config field outside ``supported`` raises a ValueError naming it."""
    fresh = _fresh()
    defaults = _global_defaults()
    values = {k: defaults[k] for k in DEFAULTS_READ if k in defaults}
    configured = {**set_fields(model_config, fresh), **set_fields(generation_config, fresh)}
    unsupported = sorted(k for k, v in configured.items() if k not in supported and v not in (None, False))
    if unsupported:
        raise ValueError(
            f"generation_config sets {', '.join(unsupported)}, which polyfuse's generate() does not support"
        )
    values.update((k, v) for k, v in configured.items() if k in supported)
    values.update(kwargs)
    return {k: v for k, v in values.items() if v is not None}


def model_generation_config(model) -> Optional[object]:
    """The model's ``generation_config`` (transformers' attribute; None for a model without one)."""
    return getattr(model, "generation_config", None)
