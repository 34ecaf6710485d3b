"""Prometheus metrics for `/metrics`: request latencies observed by the server, engine state read on scrape."""
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # the *_created series double the output and no dashboard reads them

PREFIX = "trtllm_qwenvl_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)


class EngineCollector:
    """Reads the engine's counters at scrape time, so the engine keeps no Prometheus objects in its loop."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total)
        yield gauge("kv_cache_blocks_used", "KV cache blocks held by requests.", s.kv_blocks_used)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks held by requests.",
                    s.kv_blocks_used / s.kv_blocks_total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queried_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_hit_tokens)
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits over queries, in tokens, since start.",
                    s.prefix_hit_tokens / s.prefix_queried_tokens if s.prefix_queried_tokens else 0.0)
        yield counter("num_preemptions", "Requests preempted to free KV blocks.", s.num_preemptions)
        yield counter("vision_encoder_seconds", "Device time spent in the vision encoder.", s.vision_encoder_seconds)
        yield counter("vision_items_encoded", "Images and videos run through the vision encoder.",
                      s.vision_items_encoded)


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from request arrival to its first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.preprocess = Histogram(PREFIX + "request_preprocess_seconds",
                                    "Media loading and HF preprocessing time per request.", buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter(PREFIX + "request_finished", "Finished requests by reason.", ["finished_reason"],
                                registry=r)
        r.register(EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's TTFT, ITL per completion, and e2e latency as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.last: dict[int, float] = {}  # completion index -> time of its latest token

    def preprocessed(self) -> None:
        self.metrics.preprocess.observe(time.perf_counter() - self.arrival)

    def tokens(self, index: int, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        self.metrics.generation_tokens.inc(n)
        if self.first_token is None:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
        if index in self.last:
            for _ in range(n):  # tokens that arrive together share the interval evenly
                self.metrics.itl.observe((now - self.last[index]) / n)
        self.last[index] = now

    def finished(self, reasons: list[str | None], prompt_tokens: int) -> None:
        """`reasons` has one finish reason per completion."""
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        for reason in reasons:
            self.metrics.finished.labels(finished_reason=reason or "abort").inc()
