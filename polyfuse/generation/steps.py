"""The step modules device graphs capture, and the per-model cache of their runtime-wrapped forms.

:class:`StepModule` is one cached step returning logits (the prompt, a decode token, several positions);
:class:`TokenStep` one whole greedy token done in place on :class:`TokenState` buffers (step, argmax, EOS
bookkeeping, history write, advance of the inputs), so one graph replay per token is all the host launches. Both
call ``model.step`` (core/model_protocol.py) when they run, never a copy of it.

``model_steps(model)`` wraps them with ``runtime.graph_module`` once and keeps them on ``model.steps`` while the
model's kernels stay the same; whoever changes what a captured graph reads sets ``model.steps = None``.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from polyfuse.generation.kv_cache import bucketed, ensure_cache
from polyfuse.generation.logits_processors import mark_seen_, penalize
from polyfuse.generation.token_state import greedy_token


class StepModule(nn.Module):
    """A whole cached step as a module, the unit that device graphs capture."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, kv_len: int, input_ids, position_ids, cache_position, key_mask, logits_to_keep=None,
                hidden_layers=None):  # fmt: skip
        if hidden_layers:  # (logits, the residual stream entering those layers): speculative decoding's EAGLE-3
            return self.model.step(input_ids, position_ids, cache_position, key_mask, kv_len, logits_to_keep,
                                   hidden_layers)  # fmt: skip
        if logits_to_keep is None:  # the next-token logits [B, V]
            return self.model.step(input_ids, position_ids, cache_position, key_mask, kv_len)
        return self.model.step(input_ids, position_ids, cache_position, key_mask, kv_len, logits_to_keep)


class TokenStep(nn.Module):
    """One whole greedy token, in place: feeds ``tok`` at ``pos`` / ``cache_position``, writes the next token into
    ``history`` at column ``cache_position + 1``, then advances ``tok``, ``pos`` and ``cache_position`` to it.

    Every per-token value is a device tensor updated here, so a graph captured once per ``kv_len`` (the only Python
    value that varies) replays every token with no copies, argmax or bookkeeping launched around it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(  # 11 parameters: a graph's inputs, each a buffer or constant the capture keys on
        self,
        kv_len: int,
        tok,
        pos,
        cache_position,
        key_mask,
        finished,
        history,
        eos=None,
        pad_token_id: int = 0,
        seen=None,
        penalty: float = 1.0,
    ) -> None:
        logits = self.model.step(tok, pos, cache_position, key_mask, kv_len)
        if seen is not None:  # repetition penalty: the row's seen ids, a persistent mask updated here
            logits = penalize(logits.float(), seen, penalty)
        new = greedy_token(logits, finished, eos, pad_token_id)
        if seen is not None:
            mark_seen_(seen, new)
        history.index_copy_(1, cache_position + 1, new[:, None])
        tok.copy_(new[:, None])
        pos.add_(1)
        cache_position.add_(1)


class ModelSteps:
    """A model's steps wrapped by its runtime: ``prefill`` and ``decode`` (one :class:`StepModule`, as HPU graphs
    wrap a module once) and ``token`` (None where the runtime has no in-place decoding)."""

    def __init__(self, model):
        self.kernels = model.kernels
        flags, runtime, step = model.flags, model.runtime, StepModule(model)
        self.prefill = runtime.graph_module(step, "prefill", flags)
        self.decode = runtime.graph_module(step, "decode", flags)
        self.token = runtime.graph_module(TokenStep(model), "token", flags) if runtime.inplace_decode else None

    def reset(self) -> None:
        """Drop captured graphs: they point at a KV cache or position tables that were reallocated."""
        for step in (self.prefill, self.decode, self.token):
            if step is not None:
                step.reset()


def model_steps(model) -> ModelSteps:
    steps: Optional[ModelSteps] = getattr(model, "steps", None)
    if steps is None or steps.kernels is not model.kernels:
        steps = model.steps = ModelSteps(model)
    return steps


def forget_steps(model) -> None:
    """Drop the model's step wrappers (and the graphs they captured); the next use makes new ones."""
    model.steps = None


def prepare_cache(model, rows: int, total: int, bucket_size: int = -1) -> ModelSteps:
    """Make the model ready for cached steps of ``rows`` sequences up to ``total`` positions: a KV cache that fits
    (in whole buckets), position tables that cover them, and its steps, with graphs reset where what they hold was
    reallocated."""
    new_cache = ensure_cache(model, rows, bucketed(total, bucket_size, model.config.max_position_embeddings))
    steps = model_steps(model)
    if model.prepare_positions(total) or new_cache:  # dynamic NTK scaling may rebuild the cos/sin tables
        steps.reset()
    return steps
