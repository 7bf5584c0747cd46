"""GET /metrics: Prometheus text. Engine state (queues, pages, prefix-cache hits, preemptions) is read from
the engine's metrics snapshot at scrape time; what only the server sees (tokens served, TTFT, the gaps
between streamed tokens, rejected requests) is recorded as requests run. One registry per app, so two
servers in one process (tests) do not share counters."""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds; TTFT on a CPU ranges from milliseconds (tiny model, idle) to tens of seconds (long prompts, queued)
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# engine.metrics() key -> (metric name, help, kind)
_ENGINE_GAUGES = {
    "waiting": ("k3_requests_waiting", "requests queued for admission"),
    "running": ("k3_requests_running", "requests admitted and holding pages"),
    "pages_used": ("k3_pages_used", "pool pages held by requests"),
    "pages_free": ("k3_pages_free", "pool pages free"),
    "pages_evictable": ("k3_pages_evictable", "pool pages cached and reclaimable (refcount 0)"),
}
_ENGINE_COUNTERS = {
    "latent_hit_tokens": ("k3_prefix_cache_latent_hit_tokens", "prompt tokens whose MLA latents came from the cache"),
    "state_hit_tokens": ("k3_prefix_cache_state_hit_tokens", "prompt tokens skipped by resuming a KDA checkpoint"),
    "preemptions": ("k3_preemptions", "running requests preempted (recomputed later)"),
}


class _EngineCollector:
    """Reads one engine metrics snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def collect(self):
        stats = self.snapshot()
        for key, (name, text) in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, text, value=float(stats.get(key, 0)))
        for key, (name, text) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, text, value=float(stats.get(key, 0)))


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot))
        r = self.registry
        self.prompt_tokens = Counter("k3_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("k3_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter("k3_requests_finished", "requests finished, by reason", ["finish_reason"], registry=r)
        self.rejections = Counter("k3_requests_rejected", "requests refused, by HTTP status", ["status"], registry=r)
        self.ttft = Histogram(
            "k3_time_to_first_token_seconds", "submit to first streamed token", buckets=TTFT_BUCKETS_S, registry=r
        )
        self.itl = Histogram(
            "k3_inter_token_latency_seconds",
            "gap between a request's consecutive outputs",
            buckets=ITL_BUCKETS_S,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
