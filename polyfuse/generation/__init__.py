"""The decoding engine every model family shares: the generation loop and its strategies (greedy in place, the
per-token loop, beam search), sampling, stopping, streaming and the static KV cache. Talks to models only through
``polyfuse.core.model_protocol.CausalLM``."""
