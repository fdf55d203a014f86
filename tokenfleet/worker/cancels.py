"""Which requests this worker holds have been cancelled, at one Redis command per turn (shared
with the worker's other reads while a batch runs).

A cancel is a flag key ``P:cancel:<id>`` (for requests no worker has read yet) plus an entry on
the ``{P}:cancels`` stream (for requests already running somewhere). A request is checked once
against its flag when this worker takes it; after that, one XREAD of the cancels stream per turn
covers every request held, however many, instead of one lookup per request per step.
"""

from __future__ import annotations

from collections.abc import Hashable

import redis

from tokenfleet.core.sequence import SeqState
from tokenfleet.protocol import Keys

MAX_READ = 10_000


# ``cancelled``'s ``streamed`` when no shared pipeline read the stream this turn
NOT_READ = object()


class CancelWatch:
    def __init__(self, client: redis.Redis, keys: Keys):
        self.client = client
        self.keys = keys
        self._cursor: bytes | str = "0-0"
        self._checked: set[Hashable] = set()

    def start(self) -> None:
        """Skip cancels older than this worker: requests it takes later are checked by flag."""
        last = self.client.xrevrange(self.keys.cancels, count=1)
        self._cursor = last[0][0] if last else "0-0"

    def queue_read(self, pipe: redis.client.Pipeline) -> None:
        """Queue this turn's read of the cancels stream on a pipeline another exchange shares;
        its reply goes to :meth:`cancelled` as ``streamed``."""
        pipe.xread({self.keys.cancels: self._cursor}, count=MAX_READ)

    def cancelled(self, held: list[SeqState], streamed: object = NOT_READ) -> set[Hashable]:
        """Keys of the held sequences that were cancelled: by the stream (read here unless a
        shared pipeline's reply is given; None when it is not read this turn, its cancels left
        for the next read) and by the flags of sequences not checked before."""
        new = [seq for seq in held if seq.key not in self._checked]
        flags: list = []
        if new or streamed is NOT_READ:
            pipe = self.client.pipeline(transaction=False)  # spans slots: flags spread, the stream is tagged
            if streamed is NOT_READ:
                self.queue_read(pipe)
            for seq in new:
                pipe.exists(self.keys.cancel(seq.request.id))
            flags = pipe.execute()
            if streamed is NOT_READ:
                streamed = flags.pop(0)
        ids = self._ids(streamed)
        self._checked = {seq.key for seq in held}
        hit = {seq.key for seq in held if seq.request.id in ids}
        hit.update(seq.key for seq, flag in zip(new, flags) if flag)
        return hit

    def _ids(self, streamed: object) -> set[str]:
        """Request ids in a read of the stream; moves the cursor past it."""
        if isinstance(streamed, Exception):
            raise streamed
        ids: set[str] = set()
        for _, entries in streamed or []:
            for entry_id, fields in entries:
                self._cursor = entry_id
                raw = fields.get(b"id")
                if raw is not None:
                    ids.add(raw.decode("utf-8", "replace"))
        return ids
