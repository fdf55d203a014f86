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
from typing import Any

import redis
from redis.typing import StreamIdT

from tokenfleet import protocol
from tokenfleet.protocol import GROUP, ErrorCode, Keys, Refusal, TokenEvent, as_text
from tokenfleet.transport.intake import Entry, Incoming, decode

log = logging.getLogger(__name__)


class Reclaimer:
    """Takes over entries other consumers left idle, and vouches for the ones we hold."""

    def __init__(
        self, client: redis.Redis, streams: list[str], consumer: str, claim_idle_ms: int, max_attempts: int
    ):
        self.client = client
        self.streams = streams
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.max_attempts = max_attempts
        self._cursors = {s: "0-0" for s in streams}
        self._last_claim = float("-inf")
        self._last_touch = time.monotonic()

    def touch(self, held: Callable[[], Iterable[tuple[str, str]]]) -> None:
        """Reset the idle time of the entries this worker holds (``held()`` lists them, asked only
        when due: at most every third of the claim timeout), so no one takes them while we work."""
        now = time.monotonic()
        if (now - self._last_touch) * 1000 < self.claim_idle_ms / 3:
            return
        self._last_touch = now
        by_stream: dict[str, list[StreamIdT]] = {}
        for stream, entry_id in held():
            by_stream.setdefault(stream, []).append(entry_id)
        if not by_stream:
            return
        pipe = self.client.pipeline(transaction=False)
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, GROUP, self.consumer, 0, ids, justid=True)
        pipe.execute()

    def claim(self, room: int) -> list[Incoming]:
        """Up to ``room`` entries that other consumers left idle past the claim timeout (at most
        one look every half timeout), decoded."""
        now = time.monotonic()
        if room <= 0 or (now - self._last_claim) * 1000 < self.claim_idle_ms / 2:
            return []
        self._last_claim = now
        claimed: list[Incoming] = []
        for stream in self._with_pending():
            if len(claimed) >= room:
                break
            items = self._autoclaim(stream, room - len(claimed))
            if items:
                counts = self._deliveries(stream, [entry_id for entry_id, _ in items])
                claimed += [self._decode(Entry(stream, i, f), counts.get(i, 1)) for i, f in items]
        if claimed:
            log.info("claimed %d entries left idle by other workers", len(claimed))
        return claimed

    def _with_pending(self) -> list[str]:
        """The streams where some entry is pending at all (one pipelined look: a bucket has a
        stream per shard, and most hold nothing pending most of the time)."""
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xpending(stream, GROUP)
        replies = pipe.execute(raise_on_error=False)
        return [s for s, r in zip(self.streams, replies) if isinstance(r, dict) and r.get("pending")]

    def own(self, entries: list[Entry]) -> list[Incoming]:
        """Our own pending ``entries`` (read again after a restart), decoded."""
        by_stream: dict[str, list[Entry]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry)
        incoming = []
        for stream, items in by_stream.items():
            ids = sorted((e.entry_id for e in items), key=lambda i: tuple(map(int, i.split("-"))))
            counts = self._deliveries(stream, ids)
            incoming += [self._decode(e, counts.get(e.entry_id, 1)) for e in items]
        return incoming

    def _decode(self, entry: Entry, deliveries: int) -> Incoming:
        """A redelivered entry; one handed out more than ``max_attempts`` times (a poison entry
        that killed every worker taking it, say) is refused without being decoded again."""
        if deliveries > self.max_attempts:
            message = f"delivered {deliveries} times without finishing (max_attempts {self.max_attempts})"
            refusal = Refusal(ErrorCode.TOO_MANY_ATTEMPTS, message, dead_letter=True)
            return Incoming(entry, None, refusal, redelivered=True)
        return decode(entry, redelivered=True)

    def _autoclaim(self, stream: str, count: int) -> list[tuple[str, protocol.Fields]]:
        resp = self.client.xautoclaim(
            stream, GROUP, self.consumer, self.claim_idle_ms, start_id=self._cursors[stream], count=count
        )
        self._cursors[stream] = as_text(resp[0])
        deleted = resp[2] if len(resp) > 2 else []
        if deleted:  # trimmed or deleted while pending: nothing left to serve
            self.client.xack(stream, GROUP, *deleted)
        return [(as_text(i), f) for i, f in resp[1] or [] if f is not None]

    def _deliveries(self, stream: str, ids: list[str]) -> dict[str, int]:
        """Delivery counts of our pending ``ids`` (XAUTOCLAIM without JUSTID counted this one)."""
        rows = self.client.xpending_range(
            stream, GROUP, min=ids[0], max=ids[-1], count=len(ids) * 4 + 16, consumername=self.consumer
        )
        return {as_text(row["message_id"]): int(row["times_delivered"]) for row in rows}


@dataclass(frozen=True)
class ReplyProgress:
    """What an earlier attempt already wrote on a request's reply stream."""

    token_ids: list[int]
    texts: list[str]
    finished: bool


def read_progress(client: redis.Redis, keys: Keys, request_id: str) -> ReplyProgress:
    """Tokens already streamed for a request (in index order, each once) and whether it ended."""
    ids: list[int] = []
    texts: list[str] = []
    finished = False
    entries: Any = client.xrange(keys.reply_stream(request_id))
    for _, fields in entries:
        event = protocol.decode_event(fields)
        if isinstance(event, TokenEvent) and event.index <= len(ids) < event.index + len(event.ids):
            ids.extend(event.ids[len(ids) - event.index :])  # chunks of two racing attempts may overlap
            texts.append(event.text)
        elif event is not None and event.terminal:
            finished = True
    return ReplyProgress(ids, texts, finished)
