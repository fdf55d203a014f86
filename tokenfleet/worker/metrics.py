"""Prometheus metrics of one worker, named in the style of vLLM and Triton (``tokenfleet_*``).

Each worker owns a registry (so several workers in one process, as in tests, do not clash) and
serves it on ``--metrics-port``. Updates are plain counter/histogram calls from the loop: a few
microseconds per token.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tokenfleet.core.interface import BatchEvent

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
WASTE_BUCKETS = (0, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8)


class WorkerMetrics:
    def __init__(self, worker: str):
        self.registry = CollectorRegistry()
        labels = {"worker": worker}
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ("worker", *extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ("worker",), buckets=buckets, registry=r).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ("worker",), registry=r).labels(**labels)

        self.requests_started = counter(
            "tokenfleet_requests_started", "Requests whose first prefill ran."
        ).labels(**labels)
        self._finished = counter(
            "tokenfleet_requests_finished", "Requests that ended with done.", ("reason",)
        )
        self._failed = counter("tokenfleet_requests_failed", "Requests that ended with error.", ("code",))
        self.generation_tokens = counter("tokenfleet_generation_tokens", "Tokens generated.").labels(**labels)
        self.prompt_tokens = counter("tokenfleet_prompt_tokens", "Prompt tokens prefilled.").labels(**labels)
        self.preemptions = counter("tokenfleet_preemptions", "Sequences preempted for KV room.").labels(
            **labels
        )
        self.reclaims = counter("tokenfleet_reclaims", "Requests taken over from dead workers.").labels(
            **labels
        )
        self.queue_time = histogram(
            "tokenfleet_request_queue_time_seconds", "Enqueue to first prefill.", LATENCY_BUCKETS
        )
        self.ttft = histogram(
            "tokenfleet_time_to_first_token_seconds", "Enqueue to first token.", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "tokenfleet_inter_token_latency_seconds", "Between a request's tokens.", LATENCY_BUCKETS
        )
        self.e2e = histogram("tokenfleet_request_e2e_seconds", "Enqueue to terminal event.", LATENCY_BUCKETS)
        self.prefill_batch = histogram(
            "tokenfleet_prefill_batch_size", "Sequences per prefill formed.", BATCH_BUCKETS
        )
        self.decode_batch = histogram(
            "tokenfleet_decode_batch_size", "Sequences per decode step.", BATCH_BUCKETS
        )
        self.padding_waste = histogram(
            "tokenfleet_padding_waste_ratio", "Padded tokens / real tokens per prefill.", WASTE_BUCKETS
        )
        self.kv_blocks_used = gauge("tokenfleet_kv_blocks_used", "KV blocks in use.")
        self.kv_blocks_total = gauge("tokenfleet_kv_blocks_total", "KV blocks in the pool.")
        self.waiting = gauge("tokenfleet_requests_waiting", "Read, not started.")
        self.running = gauge("tokenfleet_requests_running", "Running sequences.")
        self._labels = labels

    def observe_batch(self, event: BatchEvent) -> None:
        """A forward pass the core ran: its batch size, and a prefill's padding waste."""
        if event.kind == "decode":
            self.decode_batch.observe(event.size)
        elif event.kind == "prefill":
            self.prefill_batch.observe(event.size)
            self.padding_waste.observe(event.padding_waste)

    def finished(self, reason: str) -> None:
        self._finished.labels(reason=reason, **self._labels).inc()

    def failed(self, code: str) -> None:
        self._failed.labels(code=code, **self._labels).inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose ``/metrics`` on ``port`` from a background thread."""
        start_http_server(port, addr=addr, registry=self.registry)
