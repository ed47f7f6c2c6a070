"""The decoding engine every model family shares: generation and sampling over a static KV cache, rotary tables,
checkpoint reading (safetensors, GGUF), building, loading and saving. Talks to models only through
``protocol.CausalLM``."""
