"""The worker: read requests from Redis, batch them, run them, stream tokens back, acknowledge.

The loop runs in-process (an accelerator worker never forks per job), in the shape of rq's
``work()``: explicit arms for Redis trouble and bugs, backoff, ``finally: teardown``. Each turn
plans its Redis round trip, exchanges, applies what came in, steps the engine once and
publishes what the step made. A request is acknowledged only after its terminal event is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time

import redis
from redis.cluster import RedisCluster

from tokenfleet.config import WorkerConfig
from tokenfleet.core.interface import EngineCore
from tokenfleet.engines import build_core
from tokenfleet.protocol import ErrorCode, Keys
from tokenfleet.protocol.adapters import AdapterRecord
from tokenfleet.ratelog import RateLimitedLog
from tokenfleet.tracing import Tracer
from tokenfleet.transport.adapters import AdapterRegistry
from tokenfleet.transport.cancels import CancelFeed
from tokenfleet.transport.intake import StreamReader, decode
from tokenfleet.transport.outbox import Outbox, is_out_of_memory
from tokenfleet.transport.reclaim import Reclaimer
from tokenfleet.transport.registry import Registry
from tokenfleet.transport.round_trip import Received, RoundTrip
from tokenfleet.transport.server.connection import BACKOFF_MAX_S, BACKOFF_START_S, connect_with_retry
from tokenfleet.worker import reading
from tokenfleet.worker.admit import Admitter
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.policy import Plan, TurnPolicy
from tokenfleet.worker.publisher import Publisher
from tokenfleet.worker.stepper import Stepper
from tokenfleet.worker.stops import enforce_stops
from tokenfleet.worker.timing import TimeSpent
from tokenfleet.worker.tuning.threads import RunQueueWait, ThreadTuner
from tokenfleet.worker.tuning.wait import WaitTuning
from tokenfleet.worker.upkeep import FleetBuckets, Upkeep

log = logging.getLogger(__name__)

OOM_RETRY_S = 0.5  # a full Redis answers at once: retrying often costs nothing, and resumes soonest
OOM_HELD = f"redis is out of memory (maxmemory): holding %d requests, trying again every {OOM_RETRY_S} s"


def thread_tuner(config: WorkerConfig, core: EngineCore) -> ThreadTuner | None:
    """The native engine's compute threads on the CPU, re-measured while serving, unless the user
    named them (``--threads``)."""
    if config.engine.threads is not None or core.backend != "native" or core.facts.device != "cpu":
        return None
    import torch

    return ThreadTuner(torch.get_num_threads(), torch.set_num_threads, RunQueueWait().share)


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        core: EngineCore | None = None,
        client: redis.Redis | None = None,
    ):
        self.config = config
        self.keys = keys = Keys(config.redis.prefix)
        self.core = core if core is not None else build_core(config)
        self._stop = threading.Event()
        self.client = client or connect_with_retry(config.redis.url, self._stop.is_set)
        self.name = config.name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        buckets = config.batching.buckets
        lanes = keys.lane_streams(buckets)
        streams = [stream for lane in lanes for stream in lane]
        reliability = config.reliability
        self.reader = StreamReader(self.client, lanes, self.name, reliability.steal_after_ms)
        self.outbox = Outbox(self.client, keys)
        self.reclaimer = Reclaimer(
            self.client, streams, self.name, reliability.claim_idle_ms, reliability.max_attempts
        )
        self.cancels = CancelFeed(self.client, keys)
        self.round_trip = RoundTrip(self.client, self.outbox, self.reader, self.cancels)
        self.metrics = WorkerMetrics(self.name, config.engine.served_name)
        self.tracer = Tracer.exporting("tokenfleet-worker", config.otlp_traces_endpoint)
        interval_ms = config.streaming.stream_interval_ms
        self.publisher = Publisher(self.outbox, self.metrics, self.name, interval_ms, self.tracer)
        self.registry = Registry(self.client, keys, self.name)
        fleet = FleetBuckets(self.registry, buckets)
        self.adapters = AdapterRegistry(self.client, keys)
        self.admitter = Admitter(
            self.client,
            keys,
            self.core,
            self.outbox,
            self.publisher,
            fleet,
            reliability.queue_timeout_s,
            self.adapters,
            config.engine.served_name,
        )
        self.tuning = WaitTuning(config.batching, self.core, self.metrics)  # --ttft-target-ms
        self.upkeep = Upkeep(
            config, self.core, self.registry, fleet, self.reader, self.reclaimer, self.metrics, self.publisher
        )
        # a cluster pipeline keeps no order across nodes: there replies go on their own
        self.policy = TurnPolicy(
            config.streaming.overlap_io,
            shared=not isinstance(self.client, RedisCluster),
            exchange_interval_s=config.streaming.exchange_interval_ms / 1000,
        )
        self.stepper = Stepper(
            self.core, self.tuning, self.policy, self.publisher, self.metrics, thread_tuner(config, self.core)
        )
        self.spent = TimeSpent()
        self.reclaimed = 0  # requests taken over from dead workers
        self.turns_failed = 0  # turns a bug ended (logged; the loop went on)
        self._draining = False
        self._warn = RateLimitedLog(log)  # repeated errors: one line per 10 s per kind
        self._recovered_own = False
        self._metrics_served = False
        self.setup_done = False

    @property
    def requests_finished(self) -> int:
        return self.publisher.requests_finished

    # -- lifecycle ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop taking new work; :meth:`run` returns once what is held has finished."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def setup(self) -> None:
        """Join the groups, announce ourselves, and take back our own unfinished entries first."""
        if self.config.metrics_port is not None and not self._metrics_served:
            self.metrics.serve(self.config.metrics_port)
            self._metrics_served = True
        self.reader.ensure_groups()
        self.upkeep.check_redis_memory(strict=False)  # `tokenfleet worker` checked strictly before
        reliability = self.config.reliability
        limits = {"interactive": reliability.max_queue, "batch": reliability.batch_max_queue}
        self.registry.announce(self.config.batching.buckets, limits)
        self._register_adapters()
        self.upkeep.heartbeat(force=True)
        self.upkeep.assign_shards()
        self.cancels.start()
        if not self._recovered_own:  # once per process
            self._recovered_own = True
            own = self.reader.read_own_pending(self.config.batching.max_batch_size * 4)
            for incoming in self.reclaimer.own(own):
                self.admitter.take(incoming)
        b = self.config.batching
        log.info(
            "worker %s serving buckets %s, max_seq_len %d (mode %s, max_batch_size %d, max_wait_ms %g)",
            self.name,
            ",".join(map(str, b.buckets)),
            b.max_seq_len,
            b.mode,
            b.max_batch_size,
            b.max_wait_ms,
        )

    def _register_adapters(self) -> None:
        """``--lora`` adapters into the fleet's registry (for the gateway and other workers), and
        into this core's slots at once."""
        records = [AdapterRecord(n, p, self.config.engine.served_name) for n, p in self.config.engine.lora]
        for record in records:
            self.adapters.add(record)
        self.core.preload(records)

    def run(self) -> None:
        """Serve until :meth:`stop`; Redis connection errors are retried with capped backoff."""
        backoff = BACKOFF_START_S
        try:
            while not (self.stopping and not self._holds_work()):
                try:
                    if not self.setup_done:
                        self.setup()
                        self.setup_done = True
                    self._turn()
                    backoff = BACKOFF_START_S
                    continue
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    log.warning("redis unavailable (%s); retrying in %.1fs", e, backoff)
                except redis.ResponseError as e:  # Redis full, or a group deleted under us (NOGROUP)
                    if is_out_of_memory(e):  # Redis answers but takes no write (even XREADGROUP)
                        self._warn.log(logging.WARNING, "oom", OOM_HELD, len(self.core.held()))
                        self._stop.wait(OOM_RETRY_S)  # room may come any second: look again soon
                        continue
                    log.warning("redis refused a command (%s); re-creating groups in %.1fs", e, backoff)
                    self.setup_done = False
                except Exception:  # a bug must not stop the fleet's worker: log it, back off, go on
                    self.turns_failed += 1
                    self.metrics.failed(ErrorCode.INTERNAL)
                    self._warn.log(logging.ERROR, "turn", "a turn of the loop failed", exc_info=True)
                time.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
        finally:
            self._teardown()

    def _holds_work(self) -> bool:
        return bool(self.core.held() or len(self.outbox))

    def _teardown(self) -> None:
        self.round_trip.close()
        with contextlib.suppress(redis.RedisError):
            self.registry.leave()
        if self.tracer is not None:
            self.tracer.shutdown()  # what is still buffered goes out
        log.info("worker %s stopped after %d requests (%s)", self.name, self.requests_finished, self.spent)

    # -- one turn: plan -> exchange -> apply -> step -> publish -------------------------------

    def _turn(self) -> None:
        plan = self.policy.plan(self.core.has_work, self.stopping, bool(len(self.outbox)))
        if plan is Plan.DRAIN and not self._draining:  # said once, when the loop first acts on a stop
            self._draining = True
            log.info("stopping: taking no new work, finishing the %d requests held", len(self.core.held()))
        began = time.perf_counter()
        exchange_s: float | None  # the Redis exchange before the step (None: hidden under it)
        match plan:
            case Plan.OVERLAP:  # the round trip runs on the I/O thread during the step
                self.round_trip.start(self._read_budget(), background=True)
                # the step's tokens are published before a cancel read meanwhile is acted on
                output, step_s = self.stepper.step(flush=self.stopping)
                self._apply(self.round_trip.finish())  # acts on: no token after a cancel's done
                exchange_s = None
            case Plan.INLINE:
                self.round_trip.start(self._read_budget(), background=False)
                self._apply(self.round_trip.finish())
                exchange_s = time.perf_counter() - began
                self.policy.round_trip_done(exchange_s)
                output, step_s = self.stepper.step(flush=self.stopping)
            case Plan.SKIP:  # cancels and new work wait for the next read
                exchange_s = 0.0
                output, step_s = self.stepper.step(flush=self.stopping)
            case Plan.SEPARATE | Plan.DRAIN:  # draining: replies and cancels, no new work
                self._apply(self._read_on_its_own(take_work=plan is Plan.SEPARATE))
                exchange_s = time.perf_counter() - began
                output, step_s = self.stepper.step(flush=self.stopping)
        # asked of the state after the step: a batch that just ended (or began) changes the answer
        if not self.policy.rides_on_steps(self.core.has_work, self.stopping):
            self._flush()  # otherwise the next turn's round trip takes them along
        self.upkeep.after_turn(output)
        self.spent.add_turn(exchange_s, step_s, time.perf_counter() - began)

    def _read_on_its_own(self, take_work: bool) -> Received:
        """A turn's exchange with no batch riding: replies flushed, then work (blocking while
        idle) and cancels read."""
        self._flush()  # never wait for work with replies unsent
        lanes = self._read_budget()
        entries = (
            self.reader.read(lanes, reading.block_ms(self.core, self.reader, lanes)) if take_work else []
        )
        # cancels only matter for what is held; new entries are checked by their flag when taken
        cancelled = self.cancels.read() if self.core.held() else set()
        return Received(entries, cancelled)

    def _read_budget(self) -> tuple[int, ...]:
        return reading.budget(self.core, self.config.batching.max_batch_size)

    def _apply(self, received: Received) -> None:
        """Act on what came in: refused writes logged, new and reclaimed work admitted, cancels
        and deadlines enforced before the next step."""
        for error in received.refused:
            log.error("redis refused a reply write: %s", error)
        for entry in received.entries:
            self.tuning.arrived(self.reader.lane_of(entry.stream))
            self.admitter.take(decode(entry))
        if not self.stopping:
            self._reclaim()
        enforce_stops(self.core, self.publisher, received.cancelled, self.config.reliability.queue_timeout_s)

    def _reclaim(self) -> None:
        # our own entries too, when they sat idle past claim_idle_ms while we held them (e.g. we
        # could not reach Redis to vouch for them): those run here already
        held = {seq.key for seq in self.core.held()}
        room = self.config.batching.max_batch_size - self.core.num_waiting
        claimed = [c for c in self.reclaimer.claim(room) if c.entry.key not in held]
        self.metrics.reclaims.inc(len(claimed))
        self.reclaimed += len(claimed)
        for incoming in claimed:
            self.admitter.take(incoming)

    def _flush(self) -> None:
        for error in self.outbox.flush():
            log.error("redis refused a reply write: %s", error)
