"""The contract between the decoding engine (generation, loading, saving) and a model family.

The engine never reaches into a model's modules: it calls only what is listed here. ``polyfuse.models.decoder``
implements all of it once for the decoder-only families; a new family subclasses that and changes what differs.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch


class CausalLM(Protocol):
    # -- set by the loader (polyfuse.loader.load) ------------------------------------------------------------
    config: object  # a transformers config of the family
    kernels: object  # polyfuse.core.Kernels
    runtime: object  # polyfuse.core.DeviceRuntime
    flags: dict
    attention_options: dict
    cache: Optional[object]  # polyfuse.generation.kv_cache.StaticKVCache, owned by the engine
    # The generation engine's step wrappers and the graphs they captured; whoever changes the modules a captured
    # graph reads (quantization swapping projections) sets it to None, and the next generate() builds new ones.
    steps: Optional[object]
    tp: object  # polyfuse.distributed.TPContext the model was built for (SINGLE: the whole model); set at construction

    device: torch.device
    dtype: torch.dtype

    # -- building (class side) ----------------------------------------------------------------------------------
    hf_architecture: str  # transformers' class name written to config.json ("LlamaForCausalLM")

    @classmethod
    def config_for(cls, raw: dict, where: str):
        """The family's transformers config from a config.json dict (or a GGUF's fields); CheckpointError if the
        model_type is not this family's."""

    def fused_projections(self) -> dict:
        """{fused parameter fragment: [(transformers' fragment, rows), ...]} for the weights fused at load time
        (``"self_attn.qkv_proj": [("self_attn.q_proj", 4096), ...]``); saving splits them back."""

    def tp_shards(self) -> dict:
        """Tensor parallelism: {transformers' fragment: polyfuse.distributed.Shard}, the rows or columns of each
        checkpoint tensor this rank reads (checkpoint/shards.py copies them); {} for a whole model. A tensor-parallel
        build calls ``cls(config, tp=ctx)`` (polyfuse/distributed/sharding.py has the split rules)."""

    def init_buffers(self, device) -> None:
        """Compute derived tables (rotary frequencies) once the model has storage on ``device``."""

    def tie_weights(self) -> None:
        """Share the LM head with the embedding where the config says so."""

    def get_output_embeddings(self) -> torch.nn.Module:
        """The LM head. Quantization (quant/quantize.py) leaves it in the run's dtype and may swap every other
        ``nn.Linear`` for a ``QLinear`` holding a packed weight, which the forward dispatches to the ``linear_q`` ops
        (models/decoder.py ``project``)."""

    # -- decoding ----------------------------------------------------------------------------------------------
    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the static KV cache the engine allocates into ``self.cache``."""

    def prepare_positions(self, length: int) -> bool:
        """Make position tables cover ``length``; True when a table was rebuilt (the engine then resets captured
        graphs, which hold the old tables)."""

    def step(self, input_ids, position_ids, cache_position, key_mask, kv_len: int, logits_to_keep=None,
             hidden_layers=None):  # fmt: skip
        """One cached step (prefill, decode, or several positions to verify): writes ``self.cache`` at
        ``cache_position``; returns the last position's logits [B, V], or with ``logits_to_keep`` = k those of the
        last k positions [B, k, V] (0: every position, as transformers' ``logits_to_keep``). Only the default may
        prune the last layer to the last row. ``hidden_layers`` (increasing layer indices; speculative decoding's
        EAGLE-3 heads): returns (logits, hidden [B, L, len(hidden_layers) * hidden size]), the residual stream
        entering each of those layers at every position of the step, concatenated in that order."""

    def compile_decoder(self, compile_fn, regional: bool = False) -> None:
        """Compile the decoder in place for inference (polyfuse.loader.compile): the whole decoder, or each decoder
        layer when ``regional``; ``compile_fn(fn)`` returns the compiled callable, None drops an earlier compile."""

    def __call__(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        """Full-sequence forward without a cache: an output with ``.logits`` (or ``.loss`` with labels)."""
