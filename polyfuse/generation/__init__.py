"""The decoding engine every model family shares. Talks to models only through
``polyfuse.core.model_protocol.CausalLM``.

generate.py (the entry) · options.py (the settings) · prompts.py · prefill.py · strategies: greedy.py (in place),
token_loop.py (per token), beam_search.py · feeds.py (decode step or cache-less forward) · steps.py (step modules,
the per-model step cache) · token_state.py · cached_step.py (one cached step, for other engines) · hooks.py (phase
boundaries) · sampling.py, logits_processors.py, stopping.py, streaming.py · kv_cache.py.
"""

from polyfuse.generation.cached_step import CachedStep
from polyfuse.generation.generate import generate
from polyfuse.generation.hooks import GenerationHooks, PhaseTimer
from polyfuse.generation.options import GenerationOptions


__all__ = ["CachedStep", "GenerationHooks", "GenerationOptions", "PhaseTimer", "generate"]
