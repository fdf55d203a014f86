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

from tokenfleet.protocol import Keys
from tokenfleet.worker.sequence import SeqState

MAX_READ = 10_000


class CancelWatch:
    def __init__(self, client: redis.Redis, keys: Keys):
        self.client = client
        self.keys = keys
        self._cursor: bytes | str = "0-0"
        self._checked: set[Hashable] = set()
        self._ids: set[str] = set()  # cancelled request ids read from the stream, not yet matched
        self._stream_read = False  # whether this turn's read of the stream already happened

    def start(self) -> None:
        """Skip cancels older than this worker: requests it takes later are checked by flag."""
        last = self.client.xrevrange(self.keys.cancels, count=1)
        self._cursor = last[0][0] if last else "0-0"

    def begin_turn(self) -> None:
        """A new turn of the worker loop: the stream has not been read for it yet."""
        self._stream_read = False

    def queue_read(self, pipe: redis.client.Pipeline) -> None:
        """Queue this turn's read of the cancels stream on a pipeline that another exchange
        shares; its reply goes to :meth:`absorb`."""
        pipe.xread({self.keys.cancels: self._cursor}, count=MAX_READ)

    def absorb(self, streamed: object) -> None:
        """Take this turn's read of the stream (ids from an earlier turn that nobody asked about
        are dropped: nothing was held then, and requests taken since were checked by flag)."""
        if isinstance(streamed, Exception):
            raise streamed
        self._ids.clear()
        for _, entries in streamed or []:
            for entry_id, fields in entries:
                self._cursor = entry_id
                raw = fields.get(b"id")
                if raw is not None:
                    self._ids.add(raw.decode("utf-8", "replace"))
        self._stream_read = True

    def cancelled(self, held: list[SeqState]) -> set[Hashable]:
        """Keys of the held sequences that were cancelled: the stream read (here, unless
        :meth:`absorb` had this turn's) and the flags of sequences not checked before."""
        new = [seq for seq in held if seq.key not in self._checked]
        flags: list = []
        if new or not self._stream_read:
            pipe = self.client.pipeline(transaction=False)  # spans slots: flags spread, the stream is tagged
            if not self._stream_read:
                self.queue_read(pipe)
            for seq in new:
                pipe.exists(self.keys.cancel(seq.request.id))
            replies = pipe.execute()
            if not self._stream_read:
                self.absorb(replies.pop(0))
            flags = replies
        self._checked = {seq.key for seq in held}
        hit = {seq.key for seq in held if seq.request.id in self._ids}
        hit.update(seq.key for seq, flag in zip(new, flags) if flag)
        self._ids.clear()
        return hit
