"""Prometheus metrics (namespace quill_) on a per-app registry, fed by engine finish hooks."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error")  # error: the request failed inside the engine

# Seconds. CPU-first: a long prompt on a small machine can take tens of seconds to prefill.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


class EngineGauges:
    """Collector that reads engine.stats() at scrape time (no stale values between scrapes)."""

    _GAUGES = (
        ("requests_running", "running", "Requests currently scheduled in the engine."),
        ("requests_waiting", "waiting", "Requests waiting for admission to a batch."),
        ("kv_blocks_used", "kv_blocks_used", "KV-cache blocks held by requests."),
        ("kv_blocks_total", "kv_blocks_total", "KV-cache blocks in the pool."),
        ("kv_blocks_cached", "kv_blocks_cached", "Free KV-cache blocks that still hold a reusable prefix."),
        ("prefix_cache_hit_rate", "prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens, since start."),
        ("spec_acceptance_rate", "spec_acceptance_rate", "Speculative tokens accepted / proposed and verified, since start."),
        ("spec_mean_accepted_length", "spec_mean_accepted_length",
         "Tokens a speculative verification yields on average (accepted proposals + its own pick), since start."),
    )
    _COUNTERS = (
        ("spec_proposed_tokens", "spec_proposed_tokens", "Speculative tokens proposed and verified."),
        ("spec_accepted_tokens", "spec_accepted_tokens", "Speculative tokens accepted into outputs."),
        ("spec_verifications", "spec_verifications", "Speculative verifications run (one per sequence and step)."),
    )

    def __init__(self, stats: Callable[[], dict | None]):
        self._stats = stats

    def collect(self):
        stats = self._stats() or {}
        for name, key, doc in self._GAUGES:
            family = GaugeMetricFamily(f"quill_{name}", doc)
            family.add_metric([], float(stats.get(key) or 0.0))
            yield family
        for name, key, doc in self._COUNTERS:
            counter = CounterMetricFamily(f"quill_{name}", doc)
            counter.add_metric([], float(stats.get(key) or 0.0))
            yield counter

    def describe(self):
        return []


class ServerMetrics:
    """The server's Prometheus registry: latency histograms, token and request counters, gauges."""

    def __init__(self, stats: Callable[[], dict | None]):
        # *_created timestamps are noise for dashboards (vLLM drops them too); process-wide switch.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        r, ns = self.registry, "quill"
        self.ttft = Histogram("time_to_first_token_seconds", "Request arrival to first output token.", namespace=ns, registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Gap between consecutive output tokens of a request.", namespace=ns, registry=r, buckets=_TOKEN_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1), per request.", namespace=ns, registry=r, buckets=_TOKEN_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Request arrival to last output token.", namespace=ns, registry=r, buckets=_LATENCY_BUCKETS)
        self.queue = Histogram("queue_time_seconds", "Request arrival to first scheduled.", namespace=ns, registry=r, buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens of finished requests, by kind (computed or cached).", ["kind"], namespace=ns, registry=r)
        self.generation_tokens = Counter("generation_tokens", "Output tokens generated.", namespace=ns, registry=r)
        self.requests = Counter("requests", "Finished completions, by finish reason (n > 1 counts n).", ["finish_reason"], namespace=ns, registry=r)
        self.errors = Counter("request_errors", "Requests answered with an error, by HTTP status and code.", ["status", "code"], namespace=ns, registry=r)
        for kind in ("computed", "cached"):
            self.prompt_tokens.labels(kind)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.registry.register(EngineGauges(stats))

    def on_request_finished(self, request_id: str, completion) -> None:
        """Engine hook (called from the engine thread): one finished completion."""
        m = completion.metrics or {}
        reason = completion.finish_reason or "abort"
        self.requests.labels(reason).inc()
        self.generation_tokens.inc(len(completion.token_ids or ()))
        if completion.index == 0:  # n > 1 completions share one prompt
            cached = m.get("cached_tokens") or 0
            self.prompt_tokens.labels("cached").inc(cached)
            if m.get("queue_ms") is not None:  # an abort while queued computed nothing
                self.prompt_tokens.labels("computed").inc(max((m.get("prompt_tokens") or 0) - cached, 0))
        if reason in ("abort", "error"):
            return  # a cut-short request's latencies would skew the distributions
        self._observe_ms(self.queue, m.get("queue_ms"))
        self._observe_ms(self.ttft, m.get("ttft_ms"))
        self._observe_ms(self.tpot, m.get("tpot_ms"))
        self._observe_ms(self.e2e, m.get("e2e_ms"))
        for gap in m.get("itl_ms") or ():
            self.itl.observe(gap / 1000.0)

    def count_error(self, status: int, code: str | None) -> None:
        self.errors.labels(str(status), code or "none").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @staticmethod
    def _observe_ms(histogram: Histogram, value_ms: float | None) -> None:
        if value_ms is not None:
            histogram.observe(value_ms / 1000.0)
