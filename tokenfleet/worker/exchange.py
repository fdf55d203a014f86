"""A busy worker's one round trip per step, optionally overlapped with the next step.

While a batch runs, each turn sends the last step's replies and reads new work and cancels in one
pipelined round trip. Run between steps, that round trip adds to every step: Redis writing the
events and waking the clients, the bytes both ways, the parse. On a tiny model
it was ~2 ms of a ~5 ms step. Overlapped, it runs on an I/O thread while the next step computes
(the model's kernels release the GIL), and a step costs the longer of the two, not their sum. The
price: work and cancels read during a step are acted on after it, one step later than otherwise.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import redis

from tokenfleet.worker.cancels import CancelWatch
from tokenfleet.worker.streams import Entry, Outbox, StreamReader


@dataclass(frozen=True)
class Received:
    """What one exchange brought back."""

    entries: list[Entry]  # new work, to accept
    cancels: object  # the cancels stream's read, for CancelWatch.cancelled
    refused: list[Exception]  # reply writes Redis refused (logged, never retried)


class Exchange:
    """Starts a round trip (:meth:`start`) and collects it (:meth:`finish`); with ``overlap`` the
    round trip runs on a thread in between. Only the thread touches Redis while one is in flight:
    between the two calls the caller may queue more events on the outbox, nothing else."""

    def __init__(
        self, client: redis.Redis, outbox: Outbox, reader: StreamReader, cancels: CancelWatch, overlap: bool
    ):
        self.client = client
        self.outbox = outbox
        self.reader = reader
        self.cancels = cancels
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenfleet-io") if overlap else None
        self._pending: Future | Callable[[], list] | None = None
        self._sent = self._room = 0

    def start(self, room: int, background: bool = True) -> None:
        """Queue the outbox's replies, a read of up to ``room`` new entries and one of the cancels
        stream; send them on the thread when ``background`` (and overlap is on), else at
        :meth:`finish`."""
        assert self._pending is None, "one exchange at a time"
        pipe = self.client.pipeline(transaction=False)
        self._sent = self.outbox.queue_into(pipe)
        self._room = room
        if room > 0:
            self.reader.queue_read(pipe, room)
        self.cancels.queue_read(pipe)
        run = functools.partial(pipe.execute, raise_on_error=False)
        self._pending = self._thread.submit(run) if background and self._thread else run

    def finish(self) -> Received:
        """Wait for the round trip. On a connection error the replies it carried go back in front
        of the outbox for the retry, and the error is raised."""
        pending, self._pending = self._pending, None
        assert pending is not None, "finish() without start()"
        try:
            replies = pending.result() if isinstance(pending, Future) else pending()
            refused = self.outbox.sent(replies[: self._sent])
            entries = self.reader.parse_queued(replies[self._sent], self._room) if self._room > 0 else []
        except BaseException:
            self.outbox.restore()
            raise
        return Received(entries, replies[-1], refused)

    def close(self) -> None:
        if self._pending is not None:
            with contextlib.suppress(redis.RedisError):  # what it carried stays in the outbox
                self.finish()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
