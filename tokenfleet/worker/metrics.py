"""Prometheus metrics of one worker: ours (``tokenfleet_*``, with ``worker`` and, where it
matters, ``lane`` labels) and their vLLM-named twins (:mod:`tokenfleet.worker.vllm_metrics`).

Each worker owns a registry (so several workers in one process, as in tests, do not clash) and
serves it on ``--metrics-port``. The loop reports events (:meth:`WorkerMetrics.started`,
:meth:`token_gap`, :meth:`finished`, ...) and each updates both families: a few microseconds per
token.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tokenfleet.core.interface import BatchEvent
from tokenfleet.protocol import LANES
from tokenfleet.transport.series import Tally
from tokenfleet.worker.vllm_metrics import VllmMetrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
WASTE_BUCKETS = (0, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8)


class WorkerMetrics:
    def __init__(self, worker: str, model_name: str = "model"):
        self.registry = r = CollectorRegistry()
        self.vllm = VllmMetrics(r, model_name, engine=worker)
        self._worker = worker
        self.tally = Tally()  # since the last heartbeat, for the fleet's time series
        mine = {"worker": worker}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ("worker", *extra), registry=r)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], extra: tuple[str, ...] = ()
        ) -> Histogram:
            return Histogram(name, doc, ("worker", *extra), buckets=buckets, registry=r)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, ("worker", *extra), registry=r)

        self.requests_started = counter(
            "tokenfleet_requests_started", "Requests whose first prefill ran."
        ).labels(**mine)
        self._finished = counter(
            "tokenfleet_requests_finished", "Requests that ended with done.", ("reason",)
        )
        self._failed = counter("tokenfleet_requests_failed", "Requests that ended with error.", ("code",))
        self.generation_tokens = counter("tokenfleet_generation_tokens", "Tokens generated.").labels(**mine)
        self.prompt_tokens = counter("tokenfleet_prompt_tokens", "Prompt tokens prefilled.").labels(**mine)
        self.preemptions = counter("tokenfleet_preemptions", "Sequences preempted for KV room.")
        self.preemptions = self.preemptions.labels(**mine)
        self.prefix_cache_queries = counter(
            "tokenfleet_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(**mine)
        self.prefix_cache_hits = counter(
            "tokenfleet_prefix_cache_hits", "Prompt tokens whose K/V the prefix cache held."
        ).labels(**mine)
        self._prefix_seen = (0, 0)  # the core's cumulative counts, last seen
        self.reclaims = counter("tokenfleet_reclaims", "Requests taken over from dead workers.")
        self.reclaims = self.reclaims.labels(**mine)
        lane = ("lane",)
        self.queue_time = histogram(
            "tokenfleet_request_queue_time_seconds", "Enqueue to first prefill.", LATENCY_BUCKETS, lane
        )
        self.ttft = histogram(
            "tokenfleet_time_to_first_token_seconds", "Enqueue to first token.", LATENCY_BUCKETS, lane
        )
        self.itl = histogram(
            "tokenfleet_inter_token_latency_seconds", "Between a request's tokens.", LATENCY_BUCKETS
        ).labels(**mine)
        self.e2e = histogram(
            "tokenfleet_request_e2e_seconds", "Enqueue to terminal event.", LATENCY_BUCKETS, lane
        )
        self.prefill_batch = histogram(
            "tokenfleet_prefill_batch_size", "Sequences per prefill formed.", BATCH_BUCKETS
        ).labels(**mine)
        self.decode_batch = histogram(
            "tokenfleet_decode_batch_size", "Sequences per decode step.", BATCH_BUCKETS
        ).labels(**mine)
        self.padding_waste = histogram(
            "tokenfleet_padding_waste_ratio", "Padded tokens / real tokens per prefill.", WASTE_BUCKETS
        ).labels(**mine)
        self.kv_blocks_used = gauge("tokenfleet_kv_blocks_used", "KV blocks in use.").labels(**mine)
        self.kv_blocks_total = gauge("tokenfleet_kv_blocks_total", "KV blocks in the pool.").labels(**mine)
        self.waiting = gauge("tokenfleet_requests_waiting", "Read, not started, per lane.", lane)
        self.running = gauge("tokenfleet_requests_running", "Running sequences.").labels(**mine)
        self.adapters_resident = gauge(
            "tokenfleet_lora_adapters_resident", "LoRA adapters loaded in this worker's slots."
        ).labels(**mine)
        self.redis_evicting = gauge(
            "tokenfleet_redis_evicting",
            "1: Redis's maxmemory-policy may delete our keys (not noeviction); 0: safe; -1: unknown.",
        ).labels(**mine)
        self.batch_wait = gauge(
            "tokenfleet_batch_wait_ms",
            "The wait for a batch to fill now in force per lane (max_wait_ms, or the TTFT target's choice).",
            lane,
        )

    # -- per request ------------------------------------------------------------------------------

    def started(self, lane: str, prompt_tokens: int, queue_s: float, ttft_s: float) -> None:
        """A request's first token (its prefill ran; ``queue_s``: enqueue to prefill)."""
        self.requests_started.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.queue_time.labels(worker=self._worker, lane=lane).observe(queue_s)
        self.ttft.labels(worker=self._worker, lane=lane).observe(ttft_s)
        self.tally.start(queue_s, ttft_s)
        self.vllm.started(prompt_tokens, queue_s, ttft_s)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm.inter_token.observe(seconds)

    def generated(self, tokens: int) -> None:
        self.tally.tokens += tokens
        self.generation_tokens.inc(tokens)
        self.vllm.generation_tokens.inc(tokens)

    def finished(self, reason: str, lane: str = LANES[0], e2e_s: float | None = None) -> None:
        self.tally.finished += 1
        self._finished.labels(reason=reason, worker=self._worker).inc()
        if e2e_s is not None:
            self.e2e.labels(worker=self._worker, lane=lane).observe(e2e_s)
        self.vllm.finished(reason, e2e_s)

    def failed(self, code: str) -> None:
        self.tally.failed += 1
        self._failed.labels(code=code, worker=self._worker).inc()
        self.vllm.finished("error", None)

    def take_tally(self) -> dict[str, float]:
        """What was tallied since the last call, as the time series' fields; a new tally starts."""
        sample, self.tally = self.tally.fields(), Tally()
        return sample

    def preempted(self, count: int) -> None:
        self.preemptions.inc(count)
        self.vllm.preemptions.inc(count)

    # -- per step and per turn --------------------------------------------------------------------

    def observe_batch(self, event: BatchEvent) -> None:
        """A forward pass the core ran: its batch size, and a prefill's padding waste."""
        if event.kind == "decode":
            self.decode_batch.observe(event.size)
        elif event.kind == "prefill":
            self.prefill_batch.observe(event.size)
            self.padding_waste.observe(event.padding_waste)

    def state(self, running: int, waiting: dict[str, int], kv_used: int, kv_total: int) -> None:
        """The engine's occupancy now: running sequences, waiting ones per lane, KV blocks."""
        self.running.set(running)
        for lane, count in waiting.items():
            self.waiting.labels(worker=self._worker, lane=lane).set(count)
        self.kv_blocks_used.set(kv_used)
        self.kv_blocks_total.set(kv_total)
        self.vllm.state(running, sum(waiting.values()), kv_used / kv_total if kv_total else 0.0)

    def prefix_cache(self, queries: int, hits: int) -> None:
        """The core's cumulative prefix-cache counts (tokens); counters move by what is new."""
        seen_queries, seen_hits = self._prefix_seen
        if queries > seen_queries or hits > seen_hits:
            new_queries, new_hits = max(0, queries - seen_queries), max(0, hits - seen_hits)
            self.prefix_cache_queries.inc(new_queries)
            self.prefix_cache_hits.inc(new_hits)
            self.vllm.prefix_cache(new_queries, new_hits)
            self._prefix_seen = (queries, hits)

    def wait_in_force(self, lane: str, wait_ms: float) -> None:
        self.batch_wait.labels(worker=self._worker, lane=lane).set(wait_ms)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose ``/metrics`` on ``port`` from a background thread."""
        start_http_server(port, addr=addr, registry=self.registry)
