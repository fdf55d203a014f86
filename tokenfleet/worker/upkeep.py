"""What a worker does between turns on its own clock: heartbeats, vouching for the entries it
holds, trimming acknowledged entries, keeping the fleet's bucket list fresh, the capacity
gauges, and an integrity check whenever a burst of work is done."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenfleet.config import WorkerConfig
from tokenfleet.core.interface import EngineCore, StepOutput
from tokenfleet.protocol import LANES
from tokenfleet.protocol.affinity import SHARDS
from tokenfleet.transport.intake import StreamReader
from tokenfleet.transport.reclaim import Reclaimer
from tokenfleet.transport.registry import Registry, heartbeats
from tokenfleet.transport.server.memory import RECHECK_S, MemoryPolicy, check_memory_policy
from tokenfleet.transport.shards import assign
from tokenfleet.worker.metrics import WorkerMetrics
from tokenfleet.worker.publisher import Publisher

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
FLEET_BUCKETS_TTL_S = 10.0


class FleetBuckets:
    """The buckets live workers serve, looked up at most every :data:`FLEET_BUCKETS_TTL_S`."""

    def __init__(self, registry: Registry, own: tuple[int, ...], clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.own = own
        self.clock = clock
        self._buckets = sorted(own)
        self._at = float("-inf")

    def get(self, refresh: bool = False) -> list[int]:
        now = self.clock()
        if refresh or now - self._at > FLEET_BUCKETS_TTL_S:
            self._buckets = self.registry.live_buckets(self.own)
            self._at = now
        return self._buckets


class Upkeep:
    """The worker's periodic chores, run after every turn (each on its own interval)."""

    def __init__(
        self,
        config: WorkerConfig,
        core: EngineCore,
        registry: Registry,
        fleet: FleetBuckets,
        reader: StreamReader,
        reclaimer: Reclaimer,
        metrics: WorkerMetrics,
        publisher: Publisher,
    ):
        self.config = config
        self.core = core
        self.registry = registry
        self.fleet = fleet
        self.reader = reader
        self.reclaimer = reclaimer
        self.metrics = metrics
        self.publisher = publisher
        self.capacity = core.capacity()
        self._kv_peak = self.capacity  # the pool at its fullest since the last burst ended
        self._last_heartbeat = 0.0
        self._tokens_at_heartbeat = 0
        self._last_trim = time.monotonic()
        self._shards_owned = -1
        self._memory: MemoryPolicy | None = None
        self._memory_checked = float("-inf")

    def after_turn(self, output: StepOutput) -> None:
        self._update_capacity()
        if output.tokens and not self.core.held():  # a burst of work is done
            self._log_memory()
            try:
                self.core.check_idle()
            except RuntimeError:  # a bug in the core's bookkeeping; the queue goes on
                log.exception("integrity check failed with the worker idle")
        self.reclaimer.touch(lambda: [seq.key for seq in self.core.held()])
        if time.monotonic() - self._last_trim > self.config.reliability.trim_interval_s:
            self._last_trim = time.monotonic()
            self.reader.trim_acknowledged()
        if self.heartbeat():
            self.assign_shards()
        self.fleet.get()  # every FLEET_BUCKETS_TTL_S: {P}:buckets keeps live workers' only
        if time.monotonic() - self._memory_checked > RECHECK_S:
            self.check_redis_memory(strict=False)  # a change after start-up: warned, never fatal

    def check_redis_memory(self, strict: bool) -> MemoryPolicy:
        """May Redis evict our keys? At start-up (``strict``: raise
        :class:`~tokenfleet.transport.server.memory.EvictingRedis`), then every
        :data:`RECHECK_S` (a restart or CONFIG SET): warned once per change, and kept in
        the ``tokenfleet_redis_evicting`` gauge."""
        self._memory_checked = time.monotonic()
        who = f"worker {self.registry.name}"
        self._memory = policy = check_memory_policy(self.registry.client, strict, who, self._memory)
        self.metrics.redis_evicting.set(-1 if policy.policy is None else int(policy.evicting))
        return policy

    def assign_shards(self) -> None:
        """Take our share of every bucket's shard streams as the heartbeats stand (a worker that
        joined or went quiet moves its shards); the rest are only stolen from."""
        if self.config.reliability.steal_after_ms == 0:  # no affinity: every shard is read alike
            return
        keys, name = self.registry.keys, self.registry.name
        beats = heartbeats(self.registry.client, keys)
        assignment = assign(keys, name, self.config.batching.buckets, beats)
        if assignment.shards_owned != self._shards_owned:
            live = sorted(b["name"] for b in beats if b.get("alive"))
            log.info(
                "owning %d of %d shards per lane (live workers: %s)",
                assignment.shards_owned,
                SHARDS * len(self.config.batching.buckets),
                ", ".join(live),
            )
            self._shards_owned = assignment.shards_owned
        self.reader.assign(assignment.own, assignment.others)

    def heartbeat(self, force: bool = False) -> bool:
        """Publish our state when due (every :data:`HEARTBEAT_S`); whether it was."""
        now = time.time()
        if not force and now - self._last_heartbeat < HEARTBEAT_S:
            return False
        generated = self.publisher.tokens_generated
        elapsed = now - self._last_heartbeat
        rate = (generated - self._tokens_at_heartbeat) / elapsed if elapsed < 60 else 0.0
        self._tokens_at_heartbeat, self._last_heartbeat = generated, now
        cap, facts = self.capacity, self.core.facts
        self.registry.beat(
            {
                "buckets": list(self.config.batching.buckets),
                "engine": self.core.backend,
                "model": self.config.engine.served_name,
                "task": facts.task,
                "device": facts.device,
                "dtype": facts.dtype,
                "mode": self.config.batching.mode,
                "running": cap.running,
                "waiting": cap.waiting,
                # read, not started, per priority lane (every worker serves both)
                "lanes": {lane: self.core.waiting_in(rank) for rank, lane in enumerate(LANES)},
                "kv_blocks_used": cap.kv_blocks_used,
                "kv_blocks_total": cap.kv_blocks_total,
                "finished": self.publisher.requests_finished,
                "tokens_per_s": round(rate, 1),
                "prefix_cache_queries": cap.prefix_cache_queries,
                "prefix_cache_hits": cap.prefix_cache_hits,
                "shards_owned": max(0, self._shards_owned),  # affinity shards per lane, all buckets
                "adapters": list(cap.adapters),  # LoRA adapters resident
            },
            self.metrics.take_tally(),
        )
        return True

    def _update_capacity(self) -> None:
        self.capacity = cap = self.core.capacity()
        if cap.kv_blocks_used > self._kv_peak.kv_blocks_used:
            self._kv_peak = cap
        waiting = {lane: self.core.waiting_in(rank) for rank, lane in enumerate(LANES)}
        self.metrics.state(cap.running, waiting, cap.kv_blocks_used, cap.kv_blocks_total)
        self.metrics.prefix_cache(cap.prefix_cache_queries, cap.prefix_cache_hits)
        self.metrics.adapters_resident.set(len(cap.adapters))

    def _log_memory(self) -> None:
        """How full the KV pool got, next to what a contiguous cache preallocated for
        max_batch_size x max_seq_len would have reserved."""
        peak, b = self._kv_peak, self.config.batching
        mib = 2**20
        log.info(
            "KV pool peak: %d/%d blocks used (%d free); %.1f MiB vs %.1f MiB for a contiguous %dx%d cache",
            peak.kv_blocks_used,
            peak.kv_blocks_total,
            peak.kv_blocks_free,
            peak.kv_bytes_used / mib,
            peak.contiguous_bytes(b.max_batch_size, b.max_seq_len) / mib,
            b.max_batch_size,
            b.max_seq_len,
        )
        self._kv_peak = self.capacity
