"""``GET /metrics``: Prometheus text through prometheus_client, in a registry of the server's own.

Gauges are read from the engine when scraped (running / waiting requests, KV blocks in use and in all, the share of
the used blocks' slots holding a token, tokens/s over the last 10 s); histograms and counters are observed as
tokens are handed out (time to first token, time per output token after the first, end-to-end latency, tokens,
finished requests by reason, preemptions, prefix-cache hits). With speculative decoding: drafted and accepted
tokens, the acceptance rate and the tokens a decoding sequence gains per step.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (the response's media type)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)


LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PER_TOKEN = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        g = lambda name, doc: Gauge(name, doc, list(labels), registry=r).labels(**labels)  # noqa: E731
        c = lambda name, doc: Counter(name, doc, list(labels), registry=r).labels(**labels)  # noqa: E731
        self.running = g("polyfuse_num_requests_running", "Sequences in the running batch")
        self.waiting = g("polyfuse_num_requests_waiting", "Sequences waiting to be scheduled")
        self.blocks_used = g("polyfuse_kv_blocks_used", "KV-cache blocks held by sequences")
        self.blocks_total = g("polyfuse_kv_blocks_total", "KV-cache blocks in all (the padding block excluded)")
        self.usage = g("polyfuse_kv_cache_usage_ratio", "Share of the KV-cache blocks in use")
        self.fill = g("polyfuse_kv_block_fill_ratio", "Share of the used blocks' slots holding a computed token")
        self.tps = g("polyfuse_generation_tokens_per_second", "Output tokens per second over the last 10 s")
        self.prompt_tokens = c("polyfuse_prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = c("polyfuse_generation_tokens", "Output tokens generated")
        self.preemptions = c("polyfuse_num_preemptions", "Sequences preempted (recomputed later)")
        self.hit_tokens = c("polyfuse_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache")
        self.query_tokens = c("polyfuse_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache")
        self.aborts = c("polyfuse_request_aborted", "Requests cancelled by their client")
        self.success = Counter("polyfuse_request_success", "Finished choices by finish reason",
                               ["model_name", "finished_reason"], registry=r)  # fmt: skip
        self.ttft = Histogram("polyfuse_time_to_first_token_seconds", "Time to first token", list(labels),
                              buckets=LATENCY, registry=r).labels(**labels)  # fmt: skip
        self.tpot = Histogram("polyfuse_time_per_output_token_seconds", "Time per output token after the first",
                              list(labels), buckets=PER_TOKEN, registry=r).labels(**labels)  # fmt: skip
        self.e2e = Histogram("polyfuse_e2e_request_latency_seconds", "Request latency", list(labels),
                             buckets=LATENCY, registry=r).labels(**labels)  # fmt: skip
        self.spec_drafted = c("polyfuse_spec_decode_num_draft_tokens", "Speculative decoding: tokens drafted")
        self.spec_accepted = c("polyfuse_spec_decode_num_accepted_tokens", "Speculative decoding: drafts accepted")
        self.spec_steps = c("polyfuse_spec_decode_num_decode_steps", "Speculative decoding: decode steps x sequences")
        self.spec_rate = g("polyfuse_spec_decode_draft_acceptance_rate", "Accepted over drafted tokens")
        self.spec_tokens = g("polyfuse_spec_decode_mean_accepted_tokens_per_step",
                             "Tokens a decoding sequence gains per step: accepted drafts + the model's own (1: none)")  # fmt: skip
        self.model_name = model_name
        self._seen = {"prompt": 0, "generation": 0, "preemptions": 0, "hits": 0, "queries": 0, "drafted": 0,
                      "accepted": 0, "decode_steps": 0}  # fmt: skip

    # observed by the engine thread as tokens are handed out
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, reason: str, total_s: float, after_first_s: float, tokens: int) -> None:
        self.success.labels(model_name=self.model_name, finished_reason=reason).inc()
        self.e2e.observe(total_s)
        if tokens > 1:
            self.tpot.observe(after_first_s / (tokens - 1))

    def aborted(self) -> None:
        self.aborts.inc()

    def _count(self, counter, key: str, value: int) -> None:
        if value > self._seen[key]:
            counter.inc(value - self._seen[key])
            self._seen[key] = value

    def render(self, aengine) -> bytes:
        """The exposition text, the engine's gauges and counters read now."""
        eng = aengine.engine
        self.running.set(eng.num_running)
        self.waiting.set(aengine.num_waiting)
        self.blocks_used.set(eng.blocks.num_used)
        self.blocks_total.set(eng.blocks.usable_blocks)
        self.usage.set(eng.blocks.num_used / max(eng.blocks.usable_blocks, 1))
        self.fill.set(eng.block_fill())
        self.tps.set(aengine.tokens_per_second())
        self._count(self.prompt_tokens, "prompt", eng.stats.prompt_tokens)
        self._count(self.generation_tokens, "generation", eng.stats.generation_tokens)
        self._count(self.preemptions, "preemptions", eng.scheduler.preemptions)
        self._count(self.hit_tokens, "hits", eng.blocks.hit_tokens)
        self._count(self.query_tokens, "queries", eng.blocks.queried_tokens)
        if eng.spec is not None:
            spec = eng.spec
            self._count(self.spec_drafted, "drafted", spec.drafted)
            self._count(self.spec_accepted, "accepted", spec.accepted)
            self._count(self.spec_steps, "decode_steps", spec.decode_steps)
            self.spec_rate.set(spec.acceptance_rate)
            self.spec_tokens.set(spec.tokens_per_step)
        return generate_latest(self.registry)
