"""The serving engine: requests in, a step at a time, text out.

``Engine.step()`` runs one iteration: the scheduler picks the step's sequences (scheduler.py), the runner builds
the batch's tensors and runs the model's paged step (runner.py), each sequence that produced logits gets its next
token with its own parameters (sampling.py), its text grows incrementally (detokenize.py) and it finishes on an
EOS / stop token, a stop string, ``max_tokens`` or ``max_model_len``; finished sequences give their blocks back
before the step returns. A request with ``n > 1`` is ``n`` sequences (choices) sharing the prompt through the prefix
cache. The engine is single-threaded: async_engine.py drives it from a thread of its own.

With speculative decoding (``EngineConfig.speculative``, speculation.py) a decoding sequence's step verifies the
tokens prompt lookup drafted for it and may add several tokens; each is checked for the end in turn, so nothing
past an EOS, a stop string or ``max_tokens`` is added, and the cache is rolled back past the rejected drafts.

Multi-step decoding (``EngineConfig.num_scheduler_steps`` N > 1): a step whose batch is all decodes runs N decode
steps back to back on the device (each step's tokens feed the next, one host read-back for the N), then adds the
tokens to each sequence in turn with the same end checks, so nothing past its end is returned; requests that
arrive meanwhile wait at most those N steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from polyfuse.generation.speculative.settings import SpeculativeSetting
from polyfuse.serving.block_manager import BlockManager
from polyfuse.serving.detokenize import Detokenizer, find_stop, ready_text
from polyfuse.serving.kv_cache import PagedKVCache
from polyfuse.serving.request import SamplingParams, Sequence
from polyfuse.serving.runner import Item, ModelRunner
from polyfuse.serving.sampling import draw_tokens, sample, token_logprobs
from polyfuse.serving.scheduler import Scheduler
from polyfuse.serving.speculation import PromptLookupDrafter, SpecStats, choose


logger = logging.getLogger("polyfuse")


@dataclass
class EngineConfig:
    max_model_len: int
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefix_caching: bool = True
    bucket_size: int = 128  # Gaudi's static-shape step (runner.py)
    seed: int = 0
    speculative: Optional[SpeculativeSetting] = None  # prompt lookup's k and n-gram size (speculation.py)
    num_scheduler_steps: int = 1  # decode steps run back to back on the device per scheduling (multi-step)


@dataclass
class Delta:
    """What one step added to one choice of a request."""

    request_id: str
    index: int
    text: str
    token_ids: list
    logprobs: list  # [(token id, logprob, [(id, logprob), ...])] for the new tokens, when asked
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Stats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    finished: dict = field(default_factory=dict)  # finish reason -> count


def eos_ids(tokenizer, config) -> set:
    ids = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig, broadcast: Optional[Callable] = None):
        spec = config.speculative
        if spec is not None and spec.method != "prompt_lookup":
            raise ValueError(f"the serving engine drafts by prompt lookup only, not {spec.method}")
        if config.num_scheduler_steps < 1 or (spec is not None and config.num_scheduler_steps > 1):
            raise ValueError("num_scheduler_steps must be >= 1, and 1 with speculative decoding")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        layers, kv_heads, hd = model.kv_cache_layout()
        self.cache = PagedKVCache(
            layers, config.num_blocks, config.block_size, kv_heads, hd, model.dtype, model.device
        )
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.prefix_caching)
        self.eos = eos_ids(tokenizer, model.config)
        propose = PromptLookupDrafter(spec, self.eos, config.max_model_len) if spec is not None else None
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, propose=propose)
        self.spec = SpecStats() if spec is not None else None
        model.prepare_positions(config.max_model_len)
        self.runner = ModelRunner(model, self.cache, config.max_num_seqs, config.max_model_len, config.bucket_size)
        self.detok = Detokenizer(tokenizer)
        self.broadcast = broadcast  # tensor parallelism: hands each step's batches to the other ranks first
        # the other ranks of a tensor-parallel run follow batches as sent: they cannot feed tokens back themselves
        self.multi_steps = config.num_scheduler_steps if broadcast is None else 1
        gen_device = model.device if model.device.type == "cuda" else "cpu"
        self.generator = torch.Generator(device=gen_device).manual_seed(config.seed)
        self.gen_device = gen_device
        self.requests: dict = {}  # request id -> its sequences
        self.stats = Stats()

    # -- requests --------------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list, params: SamplingParams) -> list:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is in use")
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if len(prompt) + params.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} exceed max_model_len "
                f"{self.config.max_model_len}"
            )
        if self.blocks.blocks_for(len(prompt) + params.max_tokens) > self.blocks.usable_blocks:
            raise ValueError(
                f"{len(prompt)} prompt tokens + max_tokens {params.max_tokens} need more KV blocks than the cache has "
                f"({self.blocks.usable_blocks} of {self.config.block_size} tokens)"
            )
        now = time.monotonic()
        seqs = [Sequence(request_id, i, list(prompt), params, arrival=now) for i in range(params.n)]
        for s in seqs:
            s.siblings = tuple(o for o in seqs if o is not s)
            if params.seed is not None and not params.greedy:
                s.generator = torch.Generator(device=self.gen_device).manual_seed(params.seed + s.index)
            self.scheduler.add(s)
        self.requests[request_id] = seqs
        self.stats.prompt_tokens += len(prompt)
        return seqs

    def abort(self, request_id: str) -> None:
        """Drop a request (a client that hung up): its sequences end and their blocks are freed now."""
        for s in self.requests.pop(request_id, []):
            if not s.finished:
                self.scheduler.finish(s, "abort")

    def abort_all(self) -> None:
        for rid in list(self.requests):
            self.abort(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------------------------------------------
    def step(self) -> list:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        if self.multi_steps > 1 and not plan.prefills:
            limits = self._chain_limits(plan.decodes)
            if limits is not None:
                return self._multi_step(plan, limits)
        scheduled = plan.prefills + plan.decodes
        items = [Item(s.tokens(), s.start, self.blocks.table(s.seq.seq_id), s.samples, bool(s.drafts))
                 for s in scheduled]  # fmt: skip
        n_p = len(plan.prefills)
        batches = self.runner.batches(items[:n_p], items[n_p:])
        if self.broadcast is not None:
            self.broadcast(batches)
        logits = self.runner.run(batches)
        self.scheduler.computed(plan)
        self.stats.steps += 1
        work = [s for s in scheduled if s.samples]
        if not work:
            return []
        seqs = [s.seq for s in work]
        if self.spec is None:
            tokens, logprobs = sample(logits, seqs, self.generator)
            emitted = [[t] for t in tokens]
            logprobs = [None if lp is None else [lp] for lp in logprobs]
        else:
            emitted, logprobs = choose(logits, seqs, [s.drafts for s in work], self.generator)
        now = time.monotonic()
        deltas = [self._emit(seq, toks, lps, now) for seq, toks, lps in zip(seqs, emitted, logprobs)]
        if self.spec is not None:
            self._speculated(work, emitted)
        return deltas

    def _chain_limits(self, decodes: list) -> Optional[list]:
        """Multi-step: how many of the next steps each decode may take (its ``max_tokens`` and ``max_model_len``
        allowing), with the blocks for them taken; None (a single step) when one is short of blocks or every one
        ends after a step anyway."""
        limits, n = [], self.multi_steps
        for s in decodes:
            seq = s.seq
            limits.append(min(n, seq.params.max_tokens - len(seq.output), self.config.max_model_len - seq.num_tokens))
        if max(limits) <= 1:
            return None
        for i, (s, r) in enumerate(zip(decodes, limits)):
            if not self.blocks.grow(s.seq.seq_id, s.start + r):
                for t in decodes[:i]:
                    self.blocks.shrink(t.seq.seq_id, t.start + 1)  # back to the single step's blocks
                return None
        return limits

    def _multi_step(self, plan, limits: list) -> list:
        decodes = plan.decodes
        seqs = [s.seq for s in decodes]
        items = [Item(s.tokens(), s.start, self.blocks.table(s.seq.seq_id), True) for s in decodes]
        wanted = [j for j, seq in enumerate(seqs) if seq.params.logprobs is not None]
        rows = torch.tensor(wanted, dtype=torch.long).to(self.model.device, non_blocking=True) if wanted else None
        kept = []  # logprobs: the wanted rows of each step's logits

        def choose(logits):
            if rows is not None:
                kept.append(logits.index_select(0, rows))
            return draw_tokens(logits, seqs, self.generator)

        steps = self.runner.run_chain(self.runner.chain_batches(items, limits), choose)
        tokens = torch.stack(steps)
        host = tokens.tolist()  # the one host sync of the N steps
        self.scheduler.computed(plan)
        self.stats.steps += len(steps)
        logprobs: list = [None] * len(seqs)
        if wanted:
            tops = [seqs[j].params.logprobs for j in wanted] * len(steps)
            picked = token_logprobs(torch.cat(kept), tokens[:, rows].flatten(), tops)  # [step x wanted]
            for w, j in enumerate(wanted):
                logprobs[j] = picked[w :: len(wanted)][: limits[j]]
        now = time.monotonic()
        deltas = []
        for j, s in enumerate(decodes):
            deltas.append(self._emit(s.seq, [host[i][j] for i in range(limits[j])], logprobs[j], now))
            if not s.seq.finished:
                s.seq.computed = s.start + limits[j]
        return deltas

    def _speculated(self, work: list, emitted: list) -> None:
        """Count the step's decodes and roll each sequence's cache back past its rejected drafts."""
        for s, toks in zip(work, emitted):
            if s.drafts:
                self.spec.drafted += len(s.drafts)
                self.spec.accepted += len(toks) - 1
                if not s.seq.finished:
                    self.scheduler.rollback(s.seq, s.start + len(toks))
            if s.count - len(s.drafts) == 1 and s.start >= len(s.seq.prompt):  # a decode, not a prompt's last token
                self.spec.decode_steps += 1
                self.spec.draft_steps += bool(s.drafts)

    def _finish_reason(self, seq: Sequence, token: int) -> Optional[str]:
        p = seq.params
        if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        new = self.detok.update(seq)
        if find_stop(seq, len(new)):
            return "stop"
        if len(seq.output) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _emit(self, seq: Sequence, tokens: list, logprobs: Optional[list], now: float) -> Delta:
        """Add ``tokens`` to ``seq`` in turn up to the one that ends it (the rest are dropped)."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        taken, lps, reason = [], [], None
        for i, token in enumerate(tokens):
            seq.output.append(token)
            taken.append(token)
            self.stats.generation_tokens += 1
            if logprobs is not None and logprobs[i] is not None:
                seq.logprobs.append((token, *logprobs[i]))
                lps.append((token, *logprobs[i]))
            reason = self._finish_reason(seq, token)
            if reason is not None:
                break
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
            if all(s.finished for s in self.requests.get(seq.request_id, [])):
                self.requests.pop(seq.request_id, None)
        return Delta(seq.request_id, seq.index, ready_text(seq), taken, lps, reason, len(seq.prompt),
                     seq.cached_tokens)  # fmt: skip

    # -- state, for metrics and tests --------------------------------------------------------------------------------
    def block_fill(self) -> float:
        """Of the slots in blocks that running sequences hold, the share holding a computed token (1.0: none
        wasted); a shared block counts once."""
        filled: dict = {}
        bs = self.blocks.block_size
        for s in list(self.scheduler.running):  # read from the HTTP thread too: copies, not the live lists
            for i, b in enumerate(list(self.blocks.table(s.seq_id))):
                filled[b] = max(filled.get(b, 0), min(bs, max(0, s.computed - i * bs)))
        return sum(filled.values()) / (len(filled) * bs) if filled else 1.0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
