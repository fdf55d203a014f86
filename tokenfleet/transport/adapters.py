"""The fleet's adapter registry in Redis (``{P}:adapters``): read by workers to find an adapter's
directory (a moment's cache, looked at again when a name is missing), written by ``--lora`` at a
worker's start, ``tokenfleet lora add/remove`` and the gateway's load/unload endpoints."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from tokenfleet.errors import ProtocolError
from tokenfleet.protocol import Keys
from tokenfleet.protocol.adapters import AdapterRecord

log = logging.getLogger(__name__)

FRESH_S = 5.0  # a worker's copy of an adapter's record is read again after this long
KEPT = 1024  # records (and misses) remembered, oldest forgotten first


class AdapterRegistry:
    def __init__(self, client: redis.Redis, keys: Keys, clock: Callable[[], float] = time.monotonic):
        self.client, self.keys, self.clock = client, keys, clock
        self._records: dict[str, AdapterRecord | None] = {}
        self._read: dict[str, float] = {}  # when each name's record was last read

    def get(self, name: str) -> AdapterRecord | None:
        """``name``'s record, None if the fleet does not know it: a copy read less than
        :data:`FRESH_S` ago, else (and for a name it lacks: one just added is found at once) one
        ``HGET``."""
        read_at = self._read.get(name)
        if read_at is None or self._records.get(name) is None or self.clock() - read_at > FRESH_S:
            raw = self.client.hget(self.keys.adapters, name)
            record = None
            if raw is not None:
                try:
                    record = AdapterRecord.from_json(name, raw)
                except ProtocolError as e:
                    log.warning("%s", e)
            self._records[name] = record
            self._read[name] = self.clock()
            while len(self._read) > KEPT:  # names asked for are the callers' to choose: bounded
                oldest = next(iter(self._read))
                del self._read[oldest], self._records[oldest]
        return self._records.get(name)

    def all(self) -> dict[str, AdapterRecord]:
        records = {}
        raw: dict[bytes, bytes] = self.client.hgetall(self.keys.adapters)  # type: ignore[assignment]
        for name, value in raw.items():
            try:
                records[name.decode()] = AdapterRecord.from_json(name.decode(), value)
            except ProtocolError as e:  # one bad record costs only its own adapter's requests
                log.warning("%s", e)
        return records

    def add(self, record: AdapterRecord) -> None:
        self.client.hset(self.keys.adapters, record.name, record.to_json())
        self._read.pop(record.name, None)

    def remove(self, name: str) -> bool:
        self._read.pop(name, None)
        return bool(self.client.hdel(self.keys.adapters, name))
