"""Prometheus metrics on a registry of our own (not the process-global one, so several servers or tests
in one process do not collide).

Gauges and the core's counters are read from the engine core's latest stats snapshot at scrape time;
latencies and token counts are observed in the API process as responses are built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cvllm.engine_process.messages import CoreStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class _CoreCollector(Collector):
    def __init__(self, model: str, snapshot: Callable[[], tuple[CoreStats, int] | None]):
        self.model = model
        self.snapshot = snapshot

    def collect(self) -> Iterator:
        taken = self.snapshot()
        stats, in_flight = taken if taken is not None else (CoreStats(), 0)
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric([self.model], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric([self.model], value)
            return family

        used = stats.kv_blocks_total - stats.kv_blocks_free
        yield gauge("cvllm:num_requests_running", "Requests in the running batch.", stats.running)
        yield gauge("cvllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.waiting)
        yield gauge("cvllm:num_requests_in_flight", "Requests sent to the engine core and not yet finished.",
                    in_flight)
        yield gauge("cvllm:kv_cache_blocks_total", "KV cache blocks in the pool.", stats.kv_blocks_total)
        yield gauge("cvllm:kv_cache_blocks_used", "KV cache blocks held by requests.", used)
        yield gauge("cvllm:kv_cache_usage_perc", "Fraction of the KV cache blocks in use (0-1).",
                    used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        yield counter("cvllm:num_preemptions", "Sequences preempted (recomputed later).", stats.preemptions)
        yield counter("cvllm:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                      stats.prefix_hit_tokens)
        yield counter("cvllm:prompt_tokens_computed", "Prompt tokens run through the model.",
                      stats.prompt_tokens_computed)
        yield counter("cvllm:engine_steps", "Engine steps run.", stats.steps)
        # speculative decoding (vLLM's names): acceptance rate = accepted / draft tokens, mean accepted length per
        # verification = accepted / verifications + 1
        yield counter("cvllm:spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).",
                      stats.spec_draft_tokens)
        yield counter("cvllm:spec_decode_num_accepted_tokens", "Draft tokens accepted (speculative decoding).",
                      stats.spec_accepted_tokens)
        yield counter("cvllm:spec_decode_num_drafts", "Verifications: sequence-steps that verified drafts.",
                      stats.spec_verifications)


class Metrics:
    def __init__(self, model: str, snapshot: Callable[[], tuple[CoreStats, int] | None]):
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_CoreCollector(model, snapshot))
        labels = ["model_name"]
        self.prompt_tokens = Counter("cvllm:prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                     registry=self.registry).labels(model)
        self.generation_tokens = Counter("cvllm:generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry).labels(model)
        self.requests = Counter("cvllm:request_success", "Finished completions (each of n choices) by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram("cvllm:time_to_first_token_seconds", "Time to the first generated token.", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model)
        self.itl = Histogram("cvllm:inter_token_latency_seconds", "Time between generated tokens.", labels,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(model)
        self.e2e = Histogram("cvllm:e2e_request_latency_seconds", "Time from arrival to the last token.", labels,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(model)
        self.embedding_requests = Counter("cvllm:embedding_requests", "Finished /v1/embeddings requests.", labels,
                                          registry=self.registry).labels(model)
        self.embedding_inputs = Counter("cvllm:embedding_inputs", "Inputs embedded (a request may hold several).",
                                        labels, registry=self.registry).labels(model)
        self.embedding_e2e = Histogram("cvllm:embedding_request_latency_seconds",
                                       "Time from arrival to the vectors of an embeddings request.", labels,
                                       buckets=E2E_BUCKETS, registry=self.registry).labels(model)

    def embedded(self, num_inputs: int, num_tokens: int, seconds: float) -> None:
        """An embeddings request answered: its tokens count as prompt tokens, as a completion's prompt does."""
        self.prompt_tokens.inc(num_tokens)
        self.embedding_requests.inc()
        self.embedding_inputs.inc(num_inputs)
        self.embedding_e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, arrival: float, num_prompt_tokens: int) -> RequestTimer:
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTimer(self, arrival)


class RequestTimer:
    """Observes one core request's latencies as its tokens arrive (``RequestTracker.on_tokens``)."""

    def __init__(self, metrics: Metrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.last: float | None = None

    def on_tokens(self, count: int, now: float) -> None:
        self.metrics.generation_tokens.inc(count)
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
            gap, count = 0.0, count - 1     # any others came with the first one
        else:
            gap = (now - self.last) / count  # a lagging stream gets several at once: spread the gap over them
        for _ in range(count):
            self.metrics.itl.observe(gap)
        self.last = now

    def finished(self, reasons: list[str | None], now: float) -> None:
        self.metrics.e2e.observe(now - self.arrival)
        for reason in reasons:
            self.metrics.requests.labels(self.metrics.model, reason or "abort").inc()
