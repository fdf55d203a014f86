"""Which requests were cancelled while running somewhere: one read of the cancels stream per turn
(shared with the worker's other reads while a batch runs), whatever the number of requests held.

A cancel is a flag key ``P:cancel:<id>`` (for requests no worker has taken yet; checked once, when
a worker takes one: see :func:`tokenfleet.transport.ownership.take_ownership`) plus an entry on the
``{P}:cancels`` stream (for requests already running), tailed here.
"""

from __future__ import annotations

from typing import Any

import redis

from tokenfleet.protocol import Keys

MAX_READ = 10_000  # cancels taken in one read; more wait for the next turn


class CancelFeed:
    """Tails the cancels stream from where this worker started."""

    def __init__(self, client: redis.Redis, keys: Keys):
        self.client = client
        self.keys = keys
        self._cursor: bytes | str = "0-0"

    def start(self) -> None:
        """Skip cancels older than this worker: requests it takes later are checked by flag."""
        last: Any = self.client.xrevrange(self.keys.cancels, count=1)
        self._cursor = last[0][0] if last else "0-0"

    def read(self) -> set[str]:
        """Request ids cancelled since the last read."""
        return self.parse(self.client.xread({self.keys.cancels: self._cursor}, count=MAX_READ))

    def queue_read(self, pipe: Any) -> None:
        """Queue :meth:`read` on a pipeline another exchange shares; its reply goes to :meth:`parse`."""
        pipe.xread({self.keys.cancels: self._cursor}, count=MAX_READ)

    def parse(self, reply: Any) -> set[str]:
        """Request ids in a read of the stream; moves the cursor past it."""
        if isinstance(reply, Exception):
            raise reply
        ids: set[str] = set()
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self._cursor = entry_id
                raw = fields.get(b"id")
                if raw is not None:
                    ids.add(raw.decode("utf-8", "replace"))
        return ids
