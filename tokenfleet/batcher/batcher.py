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
    """A request waiting for a batch. ``payload`` is the caller's own object, carried untouched."""

    key: Any
    prompt_len: int
    max_new_tokens: int
    arrived: float
    payload: Any = None
    bucket: int = field(default=0, init=False)
    order: int = field(default=0, init=False)  # arrival order at this batcher: breaks time ties


@dataclass(frozen=True)
class Batch:
    """Requests dispatched together, with the prompt length they are padded to."""

    items: tuple[PendingRequest, ...]
    padded_len: int

    @property
    def size(self) -> int:
        return len(self.items)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted({item.bucket for item in self.items}))

    @property
    def real_tokens(self) -> int:
        return sum(item.prompt_len for item in self.items)

    @property
    def padded_tokens(self) -> int:
        """Pad positions computed for nothing: batch size × padded length − real prompt tokens."""
        return self.size * self.padded_len - self.real_tokens

    @property
    def padding_waste(self) -> float:
        """Padded tokens per real token (0.0 when every prompt has the same length)."""
        return self.padded_tokens / self.real_tokens


class Batcher:
    """Holds pending requests per bucket and decides when a batch is due.

    ``next_batch`` applies the dispatch rule of the configured mode; ``take`` hands out waiting
    requests at once (continuous batching's joiners). Under ``bucket`` padding each batch comes
    from one bucket and the bucket whose oldest request has waited longest goes first, so a busy
    bucket cannot starve a quiet one.
    """

    def __init__(self, config: DynamicBatchingConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._queues: dict[int, deque[PendingRequest]] = {b: deque() for b in config.buckets}
        self._counter = itertools.count()

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
        self._queues[item.bucket].append(item)

    # -- inspection -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def pending(self) -> Iterable[PendingRequest]:
        for queue in self._queues.values():
            yield from queue

    def remove(self, predicate: Callable[[PendingRequest], bool]) -> list[PendingRequest]:
        """Drop and return the pending requests that match (cancelled, expired)."""
        removed: list[PendingRequest] = []
        for bucket, queue in self._queues.items():
            keep: deque[PendingRequest] = deque()
            for item in queue:
                (removed if predicate(item) else keep).append(item)
            self._queues[bucket] = keep
        return removed

    def _groups(self) -> list[deque[PendingRequest]]:
        """The queues batches are formed from: one per bucket, or one merged FIFO under ``max``."""
        if self.config.padding == "bucket":
            return [q for q in self._queues.values() if q]
        merged = sorted(self.pending(), key=lambda it: (it.arrived, it.order))
        return [deque(merged)] if merged else []

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
                due.append(group[0].arrived + self.config.max_wait_s)
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
            waited = now >= group[0].arrived + self.config.max_wait_s  # same sum as ready_at
            if full or (self.config.mode != "static" and waited):
                candidates.append(group)
        if not candidates:
            return None
        oldest = min(candidates, key=lambda g: (g[0].arrived, g[0].order))
        return self._form(oldest, limit)

    def take(self, limit: int) -> Batch | None:
        """Up to ``limit`` pending requests at once, regardless of the wait (joiners of a running
        batch). Under ``bucket`` padding they come from the bucket with the oldest request."""
        groups = self._groups()
        if not groups or limit < 1:
            return None
        oldest = min(groups, key=lambda g: (g[0].arrived, g[0].order))
        return self._form(oldest, limit)

    def requeue(self, items: list[PendingRequest]) -> None:
        """Put dispatched items back at the head of their queues (e.g. no KV room yet), in order."""
        for item in reversed(items):
            self._queues[item.bucket].appendleft(item)

    def _form(self, group: deque[PendingRequest], limit: int | None) -> Batch:
        size = min(len(group), self.config.max_batch_size, limit or self.config.max_batch_size)
        chosen = [group[i] for i in range(size)]
        taken = {id(item) for item in chosen}
        for bucket, queue in self._queues.items():
            if any(id(item) in taken for item in queue):
                self._queues[bucket] = deque(item for item in queue if id(item) not in taken)
        return Batch(items=tuple(chosen), padded_len=max(item.prompt_len for item in chosen))
