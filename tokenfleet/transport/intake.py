"""Reading work: consumer groups, bounded reads of new entries, our own pending list, and the
decoding of each entry into a request or a refusal.

A worker never takes from Redis more than it can start soon: every read is bounded by the read budget
the caller gives (``max_batch_size`` minus what waits), across all the streams it serves.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from tokenfleet import protocol
from tokenfleet.errors import ProtocolError
from tokenfleet.protocol import GROUP, Fields, Refusal, Request
from tokenfleet.transport import scripts

STEAL_LOOK_S = 0.05
"""Look at other workers' shards for entries to steal at most this often, and, idle, at least
this often (a stolen entry waited ``steal_after_ms`` already; a look costs Redis a check per
shard, ~0.1 ms in all)."""


@dataclass(frozen=True)
class Entry:
    """One request stream entry as read."""

    stream: str
    entry_id: str
    fields: Fields

    @property
    def key(self) -> tuple[str, str]:
        """Where it lies, which is also how the worker names the sequence it becomes."""
        return self.stream, self.entry_id

    @property
    def enqueued_wall(self) -> float:
        """Wall-clock time Redis accepted the entry (the millisecond part of its id)."""
        return int(self.entry_id.split("-", 1)[0]) / 1000.0


@dataclass(frozen=True)
class Incoming:
    """An entry to act on: its request, or why it will not run. ``redelivered``: it was handed
    out before (ours after a restart, or claimed from a dead worker), so it may resume."""

    entry: Entry
    request: Request | None
    refusal: Refusal | None = None
    redelivered: bool = False


def decode(entry: Entry, redelivered: bool = False) -> Incoming:
    """Decode one entry into its request, or the refusal its decoding earned."""
    try:
        return Incoming(entry, protocol.decode_request(entry.fields), redelivered=redelivered)
    except ProtocolError as e:
        return Incoming(entry, None, Refusal.of(e), redelivered)


def _fields(flat: list[Any]) -> Fields:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def _read_entries(resp: Any) -> list[Entry]:
    """The entries of an XREADGROUP reply (streams and ids as bytes, fields as a map)."""
    return [
        Entry(stream.decode(), entry_id.decode(), fields or {})
        for stream, items in resp or []
        for entry_id, fields in items
    ]


class StreamReader:
    """Reads new entries for one consumer from the request streams of each priority lane, fairly
    within a lane and bounded per lane: its own streams first, then entries that waited past
    ``steal_after_ms`` on the shards other workers own (:mod:`tokenfleet.transport.shards`)."""

    def __init__(
        self,
        client: redis.Redis,
        lanes: Sequence[Sequence[str]],
        consumer: str,
        steal_after_ms: int,
    ):
        self.client = client
        self.all_lanes = [list(streams) for streams in lanes]  # every stream this worker may read
        self.streams = [stream for streams in self.all_lanes for stream in streams]
        self._lane = {stream: k for k, streams in enumerate(self.all_lanes) for stream in streams}
        self.consumer = consumer
        self.steal_after_ms = steal_after_ms
        self._script = client.register_script(scripts.READ_BOUNDED)
        self._trim = client.register_script(scripts.TRIM_ACKED)
        self.assign([list(streams) for streams in lanes], [[] for _ in lanes])

    def assign(self, own: Sequence[Sequence[str]], others: Sequence[Sequence[str]]) -> None:
        """Which streams of each lane are read first (``own``) and which only stolen from."""
        self.lanes = [list(streams) for streams in own]
        self.others = [list(streams) for streams in others]
        self._rotations = [itertools.cycle(range(len(streams))) for streams in self.lanes]
        self._last_steal = float("-inf")

    def longest_block_ms(self, limit: int) -> int:
        """How long an idle read may block on our own streams: while other workers own shards,
        short enough to look at theirs every :data:`STEAL_LOOK_S` (a blocked read cannot)."""
        return min(limit, int(STEAL_LOOK_S * 1000)) if any(self.others) else limit

    def ensure_groups(self) -> None:
        """Create the consumer group on every stream, from id 0, so that requests enqueued before
        any worker existed are served (one pipeline: a bucket has a stream per shard)."""
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xgroup_create(stream, GROUP, id="0", mkstream=True)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception) and "BUSYGROUP" not in str(reply):
                raise reply

    def read_own_pending(self, count: int) -> list[Entry]:
        """Entries this consumer name was given and never acknowledged (a worker restarted under a
        fixed ``--name``): read from id 0, as a restarted consumer must."""
        resp = self.client.xreadgroup(GROUP, self.consumer, {s: "0" for s in self.streams}, count=count)
        return [entry for entry in _read_entries(resp) if entry.fields]  # deleted while pending: empty

    def trim_acknowledged(self) -> int:
        """Remove acknowledged entries from every stream (never an unacknowledged one), so Redis
        memory stays bounded on a long run; returns how many were removed."""
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            self._trim(keys=[stream], args=[GROUP], client=pipe)
        return sum(int(n) for n in pipe.execute())

    def read(self, budget: Sequence[int], block_ms: int | None) -> list[Entry]:
        """Up to ``budget[k]`` new entries of lane ``k``. With ``block_ms``, wait that long for the
        first one on our own streams (that wait reads at most one entry per stream); the rest is
        read without waiting, stolen entries included. Within a lane, streams are visited from a
        rotating start so that a busy stream cannot starve a quiet one."""
        budget = list(budget)
        if not any(allowed > 0 for allowed in budget):
            return []
        entries: list[Entry] = []
        if block_ms is not None:
            open_streams = [s for allowed, lane in zip(budget, self.lanes) if allowed > 0 for s in lane]
            resp = self.client.xreadgroup(
                GROUP, self.consumer, {s: ">" for s in open_streams}, count=1, block=max(1, block_ms)
            )
            entries += _read_entries(resp)
            for entry in entries:
                budget[self.lane_of(entry.stream)] -= 1
        if any(allowed > 0 for allowed in budget):
            keys, args = self._read_args(budget)
            entries += self._parse(self._script(keys=keys, args=args))
        return entries

    def queue_read(self, pipe: Any, budget: Sequence[int]) -> None:
        """Queue :meth:`read`'s non-blocking read on ``pipe`` (the script by its SHA: through a
        pipeline, redis-py's Script would cost a SCRIPT EXISTS round trip of its own)."""
        keys, args = self._read_args(budget)
        pipe.evalsha(self._script.sha, len(keys), *keys, *args)

    def parse_queued(self, reply: object, budget: Sequence[int]) -> list[Entry]:
        """The entries of a :meth:`queue_read` reply; if Redis had lost the script (a restart),
        the read is made again on its own, which loads it."""
        if isinstance(reply, redis.exceptions.NoScriptError):
            return self.read(budget, None)
        if isinstance(reply, Exception):
            raise reply
        return self._parse(reply)

    def _read_args(self, budget: Sequence[int]) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of :data:`scripts.READ_BOUNDED`: each lane's own streams from a rotating
        start, then the shards it may steal from."""
        keys: list[str] = []
        args: list[Any] = [GROUP, self.consumer, self.steal_after_ms]
        now = time.monotonic()
        steal = now - self._last_steal >= STEAL_LOOK_S  # a look at others' shards costs Redis more
        if steal:
            self._last_steal = now
        for own, others, rotation, allowed in zip(self.lanes, self.others, self._rotations, budget):
            start = next(rotation)
            theirs = others if steal else []
            keys += own[start:] + own[:start] + theirs
            args += [len(own), len(theirs), max(0, allowed)]
        return keys, args

    def lane_of(self, stream: str) -> int:
        return self._lane[stream]

    @staticmethod
    def _parse(reply: Any) -> list[Entry]:
        return [
            Entry(stream.decode(), entry_id.decode(), _fields(flat))
            for stream, items in reply
            for entry_id, flat in items
        ]
