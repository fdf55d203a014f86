"""The same measurements under vLLM's metric names (``vllm:*``, labels ``model_name`` and
``engine``), so dashboards, alerts and KEDA/HPA recipes written for vLLM work on a tokenfleet
fleet unchanged. The names and buckets follow vLLM 0.32's ``v1/metrics/loggers.py``; the mapping
to ours is in docs/operations/watch.md ("vLLM's names")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's request-latency buckets (seconds), so histogram_quantile agrees across both fleets
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(20.0, 40.0, 80.0),
)
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str):
        labels = {"model_name": model_name, "engine": engine}
        names = tuple(labels)
        self._labels = labels

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**labels)

        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time in the WAITING phase.", REQUEST_LATENCY_BUCKETS
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.inter_token = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "End to end request latency.", REQUEST_LATENCY_BUCKETS
        )
        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative preemptions.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self._success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            (*names, "finished_reason"),
            registry=registry,
        )

    def started(self, prompt_tokens: int, queue_s: float, ttft_s: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.queue_time.observe(queue_s)
        self.ttft.observe(ttft_s)

    def finished(self, reason: str, e2e_s: float | None) -> None:
        if e2e_s is not None:
            self.e2e.observe(e2e_s)
        self._success.labels(finished_reason=FINISHED_REASONS.get(reason, reason), **self._labels).inc()

    def prefix_cache(self, queries: int, hits: int) -> None:
        self.prefix_cache_queries.inc(queries)
        self.prefix_cache_hits.inc(hits)

    def state(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
