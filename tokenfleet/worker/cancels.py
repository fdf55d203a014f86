"""Which requests this worker holds have been cancelled, at one Redis command per turn.

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

    def start(self) -> None:
        """Skip cancels older than this worker: requests it takes later are checked by flag."""
        last = self.client.xrevrange(self.keys.cancels, count=1)
        self._cursor = last[0][0] if last else "0-0"

    def cancelled(self, held: list[SeqState]) -> set[Hashable]:
        """Keys of the held sequences that were cancelled."""
        new = [seq for seq in held if seq.key not in self._checked]
        pipe = self.client.pipeline(transaction=False)  # spans slots: flags spread, the stream is tagged
        pipe.xread({self.keys.cancels: self._cursor}, count=MAX_READ)
        for seq in new:
            pipe.exists(self.keys.cancel(seq.request.id))
        streamed, *flags = pipe.execute()
        ids: set[str] = set()
        for _, entries in streamed or []:
            for entry_id, fields in entries:
                self._cursor = entry_id
                raw = fields.get(b"id")
                if raw is not None:
                    ids.add(raw.decode("utf-8", "replace"))
        self._checked = {seq.key for seq in held}
        hit = {seq.key for seq in held if seq.request.id in ids}
        hit.update(seq.key for seq, flag in zip(new, flags) if flag)
        return hit
