"""A busy worker's one round trip per step: send the last step's replies, read new work and the
cancels, in one pipeline; inline, or on an I/O thread while the next step computes.

Run between steps, the round trip adds to every step (Redis writing the events and waking the
clients, the bytes both ways, the parse). Overlapped, a step costs the longer of the two, not
their sum (the model's kernels release the GIL); the price is that what is read during a step is
acted on after it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis

from tokenfleet.transport.cancels import CancelFeed
from tokenfleet.transport.intake import Entry, StreamReader
from tokenfleet.transport.outbox import Outbox


@dataclass(frozen=True)
class Received:
    """What one round trip brought back, as plain values."""

    entries: list[Entry] = field(default_factory=list)  # new work, to decode and admit
    cancelled: set[str] = field(default_factory=set)  # request ids cancelled since the last read
    refused: list[Exception] = field(default_factory=list)  # reply writes Redis refused (not retried)


class RoundTrip:
    """Starts a round trip (:meth:`start`) and collects it (:meth:`finish`); in the background,
    only the I/O thread touches Redis in between: the caller may queue events, nothing else."""

    def __init__(self, client: redis.Redis, outbox: Outbox, reader: StreamReader, cancels: CancelFeed):
        self.client = client
        self.outbox = outbox
        self.reader = reader
        self.cancels = cancels
        self._thread: ThreadPoolExecutor | None = None
        self._pending: Future[list[Any]] | Callable[[], list[Any]] | None = None
        self._sent = 0
        self._budget: tuple[int, ...] = ()

    def start(self, budget: tuple[int, ...], background: bool) -> None:
        """Queue the outbox's replies, a read of up to ``budget[k]`` new entries of each lane ``k``
        and one of the
        cancels; send them now on the I/O thread (``background``) or at :meth:`finish`."""
        assert self._pending is None, "one round trip at a time"
        pipe = self.client.pipeline(transaction=False)
        self._sent = self.outbox.queue_into(pipe)
        self._budget = budget
        if any(allowed > 0 for allowed in budget):
            self.reader.queue_read(pipe, budget)
        self.cancels.queue_read(pipe)
        run = functools.partial(pipe.execute, raise_on_error=False)
        if background:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenfleet-io")
            self._pending = self._thread.submit(run)
        else:
            self._pending = run

    def finish(self) -> Received:
        """Wait for the round trip. On a connection error the replies it carried go back in front
        of the outbox for the retry, and the error is raised."""
        pending, self._pending = self._pending, None
        assert pending is not None, "finish() without start()"
        try:
            replies = pending.result() if isinstance(pending, Future) else pending()
            refused = self.outbox.sent(replies[: self._sent])
            reading = any(allowed > 0 for allowed in self._budget)
            entries = self.reader.parse_queued(replies[self._sent], self._budget) if reading else []
            cancelled = self.cancels.parse(replies[-1])
        except BaseException:
            self.outbox.restore()
            raise
        return Received(entries, cancelled, refused)

    def close(self) -> None:
        if self._pending is not None:
            with contextlib.suppress(redis.RedisError):  # what it carried stays in the outbox
                self.finish()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
