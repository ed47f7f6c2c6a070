"""Which speculative method a generate() call runs and with how many drafted tokens k, from transformers' names
(``prompt_lookup_num_tokens``, ``max_matching_ngram_size``, ``assistant_model``, ``num_assistant_tokens``) and
polyfuse's (``speculative_model`` + ``speculative_method``, ``num_speculative_tokens``). Contradictions are one-line
ValueErrors; where speculation cannot apply (beam search, no KV cache), :func:`fallback` names what runs instead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


DEFAULT_TOKENS = {"prompt_lookup": 10, "draft": 5, "eagle3": 5}  # transformers' 10 for prompt lookup
DEFAULT_NGRAM = 2  # transformers' max_matching_ngram_size default


@dataclass(frozen=True)
class SpeculativeSetting:
    method: str  # "prompt_lookup", "draft" or "eagle3"
    k: int  # tokens drafted per verify step
    ngram: int = DEFAULT_NGRAM  # prompt lookup: the longest n-gram matched


def _method(options, assistant_model, speculative_model) -> Optional[str]:
    if assistant_model is not None and speculative_model is not None:
        raise ValueError("give assistant_model or speculative_model, not both (both name the draft)")
    asked = options.speculative_method
    given = "draft" if assistant_model is not None else None
    if speculative_model is not None:
        given = "draft" if asked == "draft" else "eagle3"
    if asked is None:
        return given or ("prompt_lookup" if options.prompt_lookup_num_tokens is not None else None)
    if asked == "prompt_lookup" and given is not None:
        raise ValueError(
            "speculative_method='prompt_lookup' drafts from the prompt: give no assistant/speculative model"
        )
    if asked != "prompt_lookup" and given is None:
        needs = "speculative_model (an EAGLE-3 head)" if asked == "eagle3" else "assistant_model (a draft model)"
        raise ValueError(f"speculative_method={asked!r} needs {needs}")
    if asked == "eagle3" and assistant_model is not None:
        raise ValueError(
            "speculative_method='eagle3' reads an EAGLE-3 head from speculative_model, not assistant_model"
        )
    return asked


def _tokens(options, method: str) -> int:
    own = options.prompt_lookup_num_tokens if method == "prompt_lookup" else None
    own = options.num_assistant_tokens if method == "draft" else own
    k = options.num_speculative_tokens
    if k is not None and own is not None and k != own:
        name = "prompt_lookup_num_tokens" if method == "prompt_lookup" else "num_assistant_tokens"
        raise ValueError(f"num_speculative_tokens={k} and {name}={own}: give one of them")
    return k if k is not None else own if own is not None else DEFAULT_TOKENS[method]


def speculative_setting(options, assistant_model=None, speculative_model=None) -> Optional[SpeculativeSetting]:
    """The setting these options and models ask for, or None (no speculation asked)."""
    method = _method(options, assistant_model, speculative_model)
    if method is None:
        if options.num_speculative_tokens is not None or options.max_matching_ngram_size is not None:
            raise ValueError(
                "num_speculative_tokens / max_matching_ngram_size need a method: prompt_lookup_num_tokens, "
                "assistant_model or speculative_model"
            )
        return None
    if options.max_matching_ngram_size is not None and method != "prompt_lookup":
        raise ValueError(f"max_matching_ngram_size is prompt lookup's; this run drafts with {method}")
    return SpeculativeSetting(method, _tokens(options, method), options.max_matching_ngram_size or DEFAULT_NGRAM)


def fallback(options) -> Optional[str]:
    """Why speculation does not run with these options and what runs instead, or None where it runs."""
    if options.num_beams > 1:
        return f"beam search (num_beams={options.num_beams}) runs without speculative decoding"
    if not options.use_cache:
        return "use_cache=False: the cache-less forward runs without speculative decoding"
    return None
