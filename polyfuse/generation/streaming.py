"""Streaming: ``generate(..., streamer=obj)`` hands tokens to ``obj`` as they are produced, with transformers'
``BaseStreamer`` protocol, so ``transformers.TextStreamer`` / ``TextIteratorStreamer`` work as they are.

The calls are transformers' own: ``put(prompt_ids)`` once ([rows, L] on the CPU, after ``num_return_sequences``
expansion), then ``put(tokens)`` once per generated position ([rows] on the CPU; rows already finished get the pad
id, as in transformers), then ``end()``. Beam search does not stream (as in transformers: beams are reordered).

Cost: a streamed token has to be on the host, so decoding with a streamer syncs once per token. The per-token loop
(sampling, HPU) syncs per token anyway. Greedy decoding under the in-place ``TokenStep`` (one CUDA-graph replay per
token) otherwise syncs once per 8 tokens; with a streamer it reads the token back after every replay instead (one
[rows] device-to-host copy and one sync per token, which also ends generation exactly at the last EOS): on an
H200, Llama-3-8B shape at batch 1, 231.1 tok/s against 233.1 without a streamer (docs/architecture.md).
"""

from __future__ import annotations


class BaseStreamer:
    """transformers' ``BaseStreamer`` interface (any object with ``put`` and ``end`` will do)."""

    def put(self, value) -> None:
        raise NotImplementedError

    def end(self) -> None:
        raise NotImplementedError


def is_rank_zero() -> bool:
    """True outside distributed runs and on global rank 0 (``RANK``, else ``LOCAL_RANK``, as torchrun sets them)."""
    from polyfuse.core import settings

    try:
        rank = settings.get("RANK")
        return (settings.get("LOCAL_RANK", 0) if rank is None else rank) == 0
    except ValueError:
        return True


def text_streamer(tokenizer):
    """The CLI's ``--stream``: transformers' ``TextStreamer`` printing the new text (prompt skipped, special tokens
    dropped) to stdout on rank 0; None on other ranks."""
    if not is_rank_zero():
        return None
    from transformers import TextStreamer

    return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
