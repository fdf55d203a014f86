"""When to dispatch which pending requests together. Pure Python: no Redis, no torch.

The clock is injected (any zero-argument callable returning seconds) so tests drive time by hand.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.protocol import smallest_bucket


@dataclass
class PendingRequest:
    """A request waiting for a batch. ``payload`` is the caller's own object, carried untouched;
    ``lane`` is its priority lane's rank (0 goes first)."""

    key: Any
    prompt_len: int
    max_new_tokens: int
    arrived: float
    payload: Any = None
    lane: int = 0
    bucket: int = field(default=0, init=False)
    order: int = field(default=0, init=False)  # arrival order at this batcher: breaks time ties


@dataclass(frozen=True)
class Batch:
    """Requests dispatched together."""

    items: tuple[PendingRequest, ...]

    @property
    def size(self) -> int:
        return len(self.items)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted({item.bucket for item in self.items}))

    @property
    def prompt_tokens(self) -> int:
        return sum(item.prompt_len for item in self.items)


class Batcher:
    """Holds pending requests per lane and bucket and decides when a batch is due.

    ``next_batch`` applies the dispatch rule of the configured mode; ``take`` hands out waiting
    requests at once (continuous batching's joiners). A batch never mixes lanes, and the highest
    lane with work goes first; a lower lane's request that has waited ``promote_after_s`` ranks
    as the highest, so lower lanes never starve. Within a rank, unless ``mix_buckets``, each
    batch comes from one bucket and the bucket whose oldest request has waited longest goes
    first, so a busy bucket cannot starve a quiet one.
    """

    def __init__(self, config: DynamicBatchingConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._queues: dict[tuple[int, int], deque[PendingRequest]] = {}
        self._counter = itertools.count()
        self._waits: dict[int, float] = {}  # lane -> wait, where a TTFT target chose one

    def set_wait(self, lane: int, seconds: float) -> None:
        """The wait for ``lane``'s batches from now on (``max_wait_ms`` until set)."""
        self._waits[lane] = seconds

    def wait_of(self, lane: int) -> float:
        return self._waits.get(lane, self.config.max_wait_s)

    # -- admission ------------------------------------------------------------------------------

    def add(self, item: PendingRequest) -> None:
        """Queue ``item`` in its bucket. Whether it may run at all is admission's call
        (:mod:`tokenfleet.core.admission`); a prompt longer than every bucket is a caller's bug."""
        bucket = smallest_bucket(self.config.buckets, item.prompt_len)
        if bucket is None:
            raise ValueError(
                f"no bucket holds a prompt of {item.prompt_len} tokens; admission should refuse it"
            )
        item.bucket = bucket
        item.order = next(self._counter)
        self._queues.setdefault((item.lane, item.bucket), deque()).append(item)

    # -- inspection -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting_in(self, lane: int) -> int:
        """Pending requests of one lane."""
        return sum(len(q) for (item_lane, _), q in self._queues.items() if item_lane == lane)

    def pending(self) -> Iterable[PendingRequest]:
        for queue in self._queues.values():
            yield from queue

    def remove(self, predicate: Callable[[PendingRequest], bool]) -> list[PendingRequest]:
        """Drop and return the pending requests that match (cancelled, expired)."""
        removed: list[PendingRequest] = []
        for name, queue in self._queues.items():
            keep: deque[PendingRequest] = deque()
            for item in queue:
                (removed if predicate(item) else keep).append(item)
            self._queues[name] = keep
        return removed

    def best_rank(self) -> int | None:
        """The lane the next request to go would go as (None: nothing waits)."""
        groups = self._groups()
        if not groups:
            return None
        now = self.clock()
        return min(self._rank(g[0], now) for g in groups)

    def _rank(self, item: PendingRequest, now: float) -> int:
        """The lane ``item`` goes as: its own, or the highest once it has waited too long."""
        return 0 if now - item.arrived >= self.config.promote_after_s else item.lane

    def _groups(self) -> list[deque[PendingRequest]]:
        """The queues batches are formed from: one per lane and bucket, or one merged queue per
        lane with ``mix_buckets``."""
        if not self.config.mix_buckets:
            return [q for q in self._queues.values() if q]
        lanes: dict[int, list[PendingRequest]] = {}
        for item in self.pending():
            lanes.setdefault(item.lane, []).append(item)
        return [deque(sorted(items, key=lambda it: (it.arrived, it.order))) for items in lanes.values()]

    def _first(self, groups: list[deque[PendingRequest]]) -> deque[PendingRequest]:
        """The group that goes first: the best-ranked head, then the oldest."""
        now = self.clock()
        return min(groups, key=lambda g: (self._rank(g[0], now), g[0].arrived, g[0].order))

    def _is_full(self, group: deque[PendingRequest]) -> bool:
        return len(group) >= self.config.max_batch_size

    def ready_at(self) -> float | None:
        """Clock time at which ``next_batch`` will return a batch (<= now: already due); None: never
        without more arrivals."""
        due: list[float] = []
        for group in self._groups():
            if self._is_full(group):
                due.append(group[0].arrived)
            elif self.config.mode != "static":
                due.append(group[0].arrived + self.wait_of(group[0].lane))
        return min(due) if due else None

    def is_due(self) -> bool:
        """Whether :meth:`next_batch` would return a batch now."""
        at = self.ready_at()
        return at is not None and at <= self.clock()

    # -- dispatch -------------------------------------------------------------------------------

    def next_batch(self, limit: int | None = None) -> Batch | None:
        """The batch that is due now under the mode's rule, or None.

        ``limit`` caps the batch below ``max_batch_size`` (e.g. free slots in a running batch).
        """
        now = self.clock()
        candidates = []
        for group in self._groups():
            full = self._is_full(group)
            waited = now >= group[0].arrived + self.wait_of(group[0].lane)  # same sum as ready_at
            if full or (self.config.mode != "static" and waited):
                candidates.append(group)
        if not candidates:
            return None
        return self._form(self._first(candidates), limit)

    def take(self, limit: int) -> Batch | None:
        """Up to ``limit`` pending requests at once, regardless of the wait (joiners of a running
        batch). Unless ``mix_buckets``, they come from the bucket with the oldest request."""
        groups = self._groups()
        if not groups or limit < 1:
            return None
        return self._form(self._first(groups), limit)

    def requeue(self, items: list[PendingRequest]) -> None:
        """Put dispatched items back at the head of their queues (e.g. no KV room yet), in order."""
        for item in reversed(items):
            self._queues.setdefault((item.lane, item.bucket), deque()).appendleft(item)

    def _form(self, group: deque[PendingRequest], limit: int | None) -> Batch:
        size = min(len(group), self.config.max_batch_size, limit or self.config.max_batch_size)
        chosen = [group[i] for i in range(size)]
        taken = {id(item) for item in chosen}
        for name, queue in self._queues.items():
            if any(id(item) in taken for item in queue):
                self._queues[name] = deque(item for item in queue if id(item) not in taken)
        return Batch(items=tuple(chosen))
