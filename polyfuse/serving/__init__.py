"""``polyfuse serve``: an OpenAI-compatible server with continuous batching over a paged KV cache (docs/serving.md).

The engine (block_manager, scheduler, runner, sampling, speculation, detokenize, engine) needs only torch and the
tokenizer; the HTTP side (api, server) needs the ``serve`` extra (fastapi, uvicorn, prometheus_client) and is imported
on demand.
"""

from polyfuse.serving.engine import Engine, EngineConfig
from polyfuse.serving.request import SamplingParams


__all__ = ["Engine", "EngineConfig", "SamplingParams"]
