"""What the sync and asyncio clients share (no I/O here): keys, tokenizer, bucket cache, request
building and validation, so that both behave the same."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

from tokenfleet import protocol
from tokenfleet.config import prefix_from_env
from tokenfleet.errors import RequestFailed
from tokenfleet.producer.routing import build_request, load_tokenizer
from tokenfleet.protocol import DoneEvent, ErrorCode, Keys, ReplyEvent, Request, TokenEvent
from tokenfleet.transport import scripts

BUCKETS_TTL_S = 10.0
RECONNECT_GIVE_UP_S = 60.0  # following a reply stream survives Redis outages this long
CANCELS_MAXLEN = 100_000  # recent cancels kept on the stream
CANCEL_TTL_S = 24 * 3600  # long enough for a queued request to be seen


RETRY_S = 0.2  # pause between reads of a reply stream while Redis is unreachable
LIVENESS_S = 5.0  # a follower that got no event this long checks that its reply stream exists
ALIVE_GROUP = "tokenfleet-alive"  # made and dropped at once: it creates the stream empty
SUBMITTED_KEPT = 100_000  # ids a client remembers submitting (their streams surely existed)


def mark_reply_stream(pipe: Any, key: str, ttl_s: int) -> None:
    """Queue, before the enqueue in one MULTI, what creates the request's reply stream empty (a
    consumer group made with MKSTREAM at id 0, then dropped, leaves an empty stream whose first
    token can still go at ``0-1``). From then on the stream exists while the request lives:
    a stream that is gone means Redis lost the request (:class:`Liveness`)."""
    pipe.xgroup_create(key, ALIVE_GROUP, id="0", mkstream=True)
    pipe.xgroup_destroy(key, ALIVE_GROUP)
    pipe.expire(key, ttl_s)


class Liveness:
    """Says ``lost`` when a followed request's reply stream is gone: it exists from the enqueue
    on (:func:`mark_reply_stream`) until its TTL, so its absence means Redis lost the request (a
    restart without persistence, a failover). Checked after :data:`LIVENESS_S` without events.
    A stream never seen (a request a producer in another language enqueued without the marker,
    not started yet) is waited for, as before."""

    def __init__(self, request_id: str, known: bool):
        self.request_id = request_id
        self.seen = known
        self.checked = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.checked >= LIVENESS_S

    def events_came(self) -> None:
        self.seen, self.checked = True, time.monotonic()

    def judge(self, exists: bool) -> None:
        """After an EXISTS of the stream; raises :class:`RequestFailed` ``lost``."""
        self.checked = time.monotonic()
        if exists:
            self.seen = True
        elif self.seen:
            message = "its request and reply stream are gone: Redis lost data (a restart without "
            raise RequestFailed(self.request_id, ErrorCode.LOST, message + "persistence, or a failover)")


class Outage:
    """Reads that failed in a row (Redis restarting, a network blip): keep following until the
    caller's timeout, or :data:`RECONNECT_GIVE_UP_S` without a connection."""

    def __init__(self) -> None:
        self.since: float | None = None

    def failed(self, error: Exception) -> float:
        """The pause before the next try; raises ``error`` once the outage is too long."""
        self.since = self.since or time.monotonic()
        if time.monotonic() - self.since > RECONNECT_GIVE_UP_S:
            raise error
        return RETRY_S

    def over(self) -> None:
        self.since = None


def new_events(resp: Any, last: Any) -> tuple[Any, list[ReplyEvent]]:
    """The events of one XREAD of a reply stream, up to and with a terminal one, and the id to
    read after next."""
    events: list[ReplyEvent] = []
    for _, items in resp or []:
        events += [event for _, event in reply_events(items)]
        last = items[-1][0] if items else last
    return last, events


def reply_events(items: Iterable[tuple[Any, dict[bytes, bytes]]]) -> Iterator[tuple[Any, ReplyEvent]]:
    """(entry id, event) for each reply entry, in order, up to and with the terminal event;
    event types this release does not know are skipped (newer workers may add some)."""
    for entry_id, fields in items:
        event = protocol.decode_event(fields)
        if event is not None:
            yield entry_id, event
            if event.terminal:
                return


class Continuity:
    """Raises ``lost`` instead of passing on a reply with a hole in it: token indexes follow one
    another, and ``done`` counts every token. Only Redis losing writes (a restart without
    persistence, a failover to a replica that lacked them) makes a hole; read past it, the
    caller would get a shorter answer that looks complete. A reader that starts after an entry
    (a resumed stream) cannot know the count before it: it checks from its first event on."""

    def __init__(self, request_id: str, from_start: bool = True):
        self.request_id = request_id
        self.next: int | None = 0 if from_start else None  # the index the next token must have

    def check(self, event: ReplyEvent) -> None:
        if isinstance(event, TokenEvent):
            expected = event.index if self.next is None else self.next
            if event.index > expected:
                raise self._lost(f"tokens {expected}-{event.index - 1} of its reply are missing")
            self.next = max(expected, event.index + len(event.ids))
        elif isinstance(event, DoneEvent) and self.next is not None and event.completion_tokens > self.next:
            raise self._lost(f"its reply holds {self.next} of the {event.completion_tokens} tokens made")

    def _lost(self, what: str) -> RequestFailed:
        message = f"{what}: Redis lost data (a restart without persistence, or a failover); submit it again"
        return RequestFailed(self.request_id, ErrorCode.LOST, message)


class ClientBase:
    def __init__(self, redis_client: Any, model: str | None, prefix: str | None, buckets: list[int] | None):
        self.redis = redis_client
        self.keys = Keys(prefix_from_env(prefix))
        self.tokenizer = load_tokenizer(model)
        self._fixed_buckets = list(buckets) if buckets else None
        self._enqueue = self.redis.register_script(scripts.ENQUEUE)
        self._buckets: list[int] = []
        self._buckets_at = float("-inf")
        self._submitted: OrderedDict[str, None] = OrderedDict()

    def _remember_submitted(self, request_id: str) -> None:
        self._submitted[request_id] = None
        if len(self._submitted) > SUBMITTED_KEPT:
            self._submitted.popitem(last=False)

    def _liveness(self, request_id: str) -> Liveness:
        return Liveness(request_id, known=request_id in self._submitted)

    def _cached_buckets(self) -> list[int] | None:
        """The bucket list if it needs no Redis round trip (given, or fresh in the cache)."""
        if self._fixed_buckets is not None:
            return self._fixed_buckets
        if time.monotonic() - self._buckets_at <= BUCKETS_TTL_S:
            return self._buckets
        return None

    def _remember_buckets(self, members: set[bytes]) -> list[int]:
        self._buckets = sorted(int(b) for b in members)
        self._buckets_at = time.monotonic()
        return self._buckets

    def _prepare(
        self, prompt: str | None, input_ids: list[int] | None, request_id: str | None, params: dict[str, Any]
    ) -> Request:
        """Build the request (token ids when the tokenizer is here) and fail here, not in a
        worker's reply, if it breaks the protocol."""
        request = build_request(prompt, input_ids, self.tokenizer, request_id, params)
        protocol.validate_request(request.to_wire())
        return request

    def _queue_cancel(self, pipe: Any, request_id: str) -> None:
        """A cancel: the flag, for a worker that takes the request later, and the stream entry,
        for one running it now."""
        pipe.set(self.keys.cancel(request_id), 1, ex=CANCEL_TTL_S)
        pipe.xadd(self.keys.cancels, {"id": request_id}, maxlen=CANCELS_MAXLEN, approximate=True)
