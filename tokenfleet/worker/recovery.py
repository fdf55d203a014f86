"""Nothing lost when a worker dies: claiming its entries, keeping ours fresh, resuming replies.

A live worker re-claims the entries it holds (XCLAIM ... JUSTID, which resets their idle time
without counting a delivery) every third of ``claim_idle_ms``; so an entry idle for longer than
``claim_idle_ms`` belongs to a dead (or wedged) worker, and XAUTOCLAIM hands it to another.
The new owner resumes from the tokens already on the reply stream: reply events have fixed ids,
so nothing is ever written twice even if the old worker wakes up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis

from tokenfleet import protocol
from tokenfleet.protocol import GROUP, EventType, Keys
from tokenfleet.worker.streams import Entry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claimed:
    entry: Entry
    deliveries: int  # how many times the group has handed this entry out, this time included


class Reclaimer:
    def __init__(self, client: redis.Redis, streams: list[str], consumer: str, claim_idle_ms: int):
        self.client = client
        self.streams = streams
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self._cursors = {s: "0-0" for s in streams}
        self._last_claim = float("-inf")
        self._last_touch = time.monotonic()
        self.reclaimed = 0

    def touch(self, held: Callable[[], Iterable[tuple[str, str]]]) -> None:
        """Reset the idle time of the entries this worker holds (``held()`` lists them, asked only
        when due: at most every third of the claim timeout), so no one takes them while we work."""
        now = time.monotonic()
        if (now - self._last_touch) * 1000 < self.claim_idle_ms / 3:
            return
        self._last_touch = now
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in held():
            by_stream.setdefault(stream, []).append(entry_id)
        if not by_stream:
            return
        pipe = self.client.pipeline(transaction=False)
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, GROUP, self.consumer, 0, ids, justid=True)
        pipe.execute()

    def claim(self, room: int) -> list[Claimed]:
        """Up to ``room`` entries that other consumers left idle past the claim timeout."""
        now = time.monotonic()
        if room <= 0 or (now - self._last_claim) * 1000 < self.claim_idle_ms / 2:
            return []
        self._last_claim = now
        claimed: list[Claimed] = []
        for stream in self.streams:
            if len(claimed) >= room:
                break
            cursor, items, deleted = self._autoclaim(stream, room - len(claimed))
            self._cursors[stream] = cursor
            if deleted:  # trimmed or deleted while pending: nothing left to serve
                self.client.xack(stream, GROUP, *deleted)
            items = [(i, f) for i, f in items if f is not None]
            if not items:
                continue
            counts = self._deliveries(stream, [i for i, _ in items])
            for entry_id, fields in items:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                claimed.append(Claimed(Entry(stream, eid, fields), counts.get(eid, 1)))
        self.reclaimed += len(claimed)
        if claimed:
            log.info("claimed %d entries left idle by other workers", len(claimed))
        return claimed

    def with_deliveries(self, entries: list[Entry]) -> list[Claimed]:
        """Our own pending ``entries`` (read again after a restart) with their delivery counts."""
        by_stream: dict[str, list[Entry]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry)
        claimed = []
        for stream, items in by_stream.items():
            ids = sorted((e.entry_id for e in items), key=lambda i: tuple(map(int, i.split("-"))))
            counts = self._deliveries(stream, ids)
            claimed += [Claimed(e, counts.get(e.entry_id, 1)) for e in items]
        return claimed

    def _autoclaim(self, stream: str, count: int) -> tuple[str, list, list]:
        resp = self.client.xautoclaim(
            stream, GROUP, self.consumer, self.claim_idle_ms, start_id=self._cursors[stream], count=count
        )
        cursor = resp[0].decode() if isinstance(resp[0], bytes) else resp[0]
        deleted = resp[2] if len(resp) > 2 else []
        return cursor, resp[1] or [], deleted

    def _deliveries(self, stream: str, ids: list) -> dict[str, int]:
        """Delivery counts (XAUTOCLAIM without JUSTID counted this one) of our pending ``ids``."""
        rows = self.client.xpending_range(
            stream, GROUP, min=ids[0], max=ids[-1], count=len(ids) * 4 + 16, consumername=self.consumer
        )
        counts = {}
        for row in rows:
            mid = row["message_id"]
            counts[mid.decode() if isinstance(mid, bytes) else mid] = int(row["times_delivered"])
        return counts


@dataclass(frozen=True)
class Progress:
    """What an earlier attempt already wrote on a request's reply stream."""

    token_ids: list[int]
    texts: list[str]
    finished: bool


def read_progress(client: redis.Redis, keys: Keys, request_id: str) -> Progress:
    """Tokens already streamed for a request (in index order, each once) and whether it ended."""
    ids: list[int] = []
    texts: list[str] = []
    finished = False
    for _, fields in client.xrange(keys.reply_stream(request_id)):
        event = protocol.decode_event(fields)
        if event["type"] == EventType.TOKEN and event["index"] <= len(ids) < event["index"] + len(
            event["ids"]
        ):
            ids.extend(event["ids"][len(ids) - event["index"] :])  # chunks of two racing attempts may overlap
            texts.append(event.get("text", ""))
        elif event["type"] in protocol.TERMINAL_EVENTS:
            finished = True
    return Progress(ids, texts, finished)
