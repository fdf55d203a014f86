"""What the sync and asyncio clients share (no I/O here): keys, tokenizer, bucket cache, request
building and validation, so that both behave the same."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from tokenfleet import protocol
from tokenfleet.config import prefix_from_env
from tokenfleet.errors import ProtocolError, RequestFailed
from tokenfleet.producer.routing import (
    build_request,
    load_tokenizer,
    next_block_ms,
    result_timeout,
    target_stream,
)
from tokenfleet.protocol import DoneEvent, ErrorCode, Keys, ReplyEvent, Request, TokenEvent
from tokenfleet.protocol.adapters import AdapterRecord
from tokenfleet.protocol.request import cannot_fit, max_token_chars
from tokenfleet.transport import scripts

BUCKETS_TTL_S = 10.0
LONG_EMBED_CHARS = 8192  # an embedding text longer than this goes to the largest bucket uncounted
RECONNECT_GIVE_UP_S = 60.0  # following a reply stream survives Redis outages this long
CANCELS_MAXLEN = 100_000  # recent cancels kept on the stream
CANCEL_TTL_S = 24 * 3600  # long enough for a queued request to be seen


RETRY_S = 0.2  # pause between reads of a reply stream while Redis is unreachable
LIVENESS_S = 5.0  # a follower that got no event this long checks that its reply stream exists
FIRST_LIVENESS_S = 1.0  # the first check sooner: a bulk job follows its lost requests one by one
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
    restart without persistence, a failover). Checked after :data:`FIRST_LIVENESS_S`, then every
    :data:`LIVENESS_S`, without events.
    A stream never seen (a request a producer in another language enqueued without the marker,
    not started yet) is waited for, as before."""

    def __init__(self, request_id: str, known: bool):
        self.request_id = request_id
        self.seen = known
        self.checked = time.monotonic()
        self.interval = FIRST_LIVENESS_S

    def wait_s(self) -> float:  # until the next check is due (0 or less: now)
        return self.checked + self.interval - time.monotonic()

    def due(self) -> bool:
        return self.wait_s() <= 0

    def events_came(self) -> None:
        self.seen, self.checked, self.interval = True, time.monotonic(), LIVENESS_S

    def judge(self, exists: bool | None) -> None:
        """After an EXISTS of the stream (None: Redis away, the read's own retries deal with it);
        raises :class:`RequestFailed` ``lost``."""
        if exists is None:  # asked again after the interval, not in a loop while Redis is away
            self.checked = time.monotonic()
            return
        self.checked, self.interval = time.monotonic(), LIVENESS_S
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


class Following:
    """One request's reply stream as its follower sees it, whoever reads it (the client's shared
    read, or a read of its own): the deadline, the id read up to, the outage and liveness verdicts,
    and the events a read brought, up to the terminal one. The clients do the reads; the
    decisions are made here, alike for both (no I/O)."""

    def __init__(self, request_id: str, key: str, timeout: float | None, after: str, known: bool):
        self.request_id = request_id
        self.key = key
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.last: Any = after  # the entry id read up to
        self.liveness = Liveness(request_id, known)
        self.outage = Outage()
        self.ended = False  # the terminal event was handed over

    def block_ms(self) -> int:
        """How long the next XREAD may block; raises :class:`ResultTimeout` past the deadline."""
        return next_block_ms(self.request_id, self.deadline, self.timeout)

    def wait_s(self) -> float:
        """How long to wait for the shared read's next entries before looking at the stream;
        raises :class:`ResultTimeout` past the deadline."""
        check_s = max(0.01, self.liveness.wait_s())
        wait_s = check_s if self.deadline is None else min(check_s, self.deadline - time.monotonic())
        if wait_s <= 0:
            raise result_timeout(self.request_id, self.timeout)
        return wait_s

    def due(self) -> bool:
        """Whether to check the stream exists after a quiet wait (then :meth:`judge` the answer)."""
        return self.liveness.due()

    def judge(self, exists: bool | None) -> None:
        self.liveness.judge(exists)

    def failed(self, error: Exception) -> float:
        """The pause before reading again after a connection error; raises it once too long."""
        return self.outage.failed(error)

    def answer(self, resp: Any) -> Iterator[ReplyEvent]:
        """The events an XREAD of this stream alone returned (``resp``), up to the terminal one."""
        self.outage.over()
        return itertools.chain.from_iterable([self.arrived(items) for _, items in resp or []])

    def arrived(self, entries: Sequence[tuple[Any, dict[bytes, bytes]]]) -> Iterator[ReplyEvent]:
        """The events of entries read from the stream, in order, up to and with the terminal one
        (decoded as they are taken: those before a malformed one are handed over first)."""
        if entries:
            self.liveness.events_came()
            self.last = entries[-1][0]  # past entries of kinds this release skips, too
        return self._decoded(entries)

    def _decoded(self, entries: Sequence[tuple[Any, dict[bytes, bytes]]]) -> Iterator[ReplyEvent]:
        for _, event in reply_events(entries):
            self.ended = event.terminal
            yield event


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


class HandleBase:
    """A submitted request (what :class:`~tokenfleet.producer.Handle` and
    :class:`~tokenfleet.producer.AsyncHandle` share)."""

    def __init__(self, request_id: str, stream: str | None = None):
        self.id = request_id
        self.stream_key = stream  # the request stream it was enqueued on

    @property
    def bucket(self) -> str | None:
        """The bucket it went to (``auto`` when a worker routes it), if submitted here."""
        return self.stream_key.split(":req:", 1)[1].split(":")[0] if self.stream_key else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"


class ClientBase:
    def __init__(self, redis_client: Any, model: str | None, prefix: str | None, buckets: list[int] | None):
        self.redis = redis_client
        self.keys = Keys(prefix_from_env(prefix))
        self.tokenizer = load_tokenizer(model)
        self.max_token_chars = max_token_chars(self.tokenizer) if self.tokenizer is not None else 0
        self._fixed_buckets = list(buckets) if buckets else None
        self._enqueue = self.redis.register_script(scripts.ENQUEUE)
        self._buckets: list[int] = []
        self._buckets_at = float("-inf")
        self._submitted: OrderedDict[str, None] = OrderedDict()

    def _remember_submitted(self, request_id: str) -> None:
        self._submitted[request_id] = None
        if len(self._submitted) > SUBMITTED_KEPT:
            self._submitted.popitem(last=False)

    def _following(self, request_id: str, timeout: float | None, after: str) -> Following:
        key = self.keys.reply_stream(request_id)
        return Following(request_id, key, timeout, after, known=request_id in self._submitted)

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
        self,
        prompt: str | None,
        input_ids: list[int] | None,
        request_id: str | None,
        params: dict[str, Any],
        buckets: list[int],
    ) -> Request:
        """Build the request (token ids when the tokenizer is here) and fail here, not in a
        worker's reply, if it breaks the protocol or its text cannot fit any bucket served
        (checked before tokenizing: a huge prompt costs nothing)."""
        # an embedding is tokenized by the worker and cut to the model's length, not refused
        tokenized_here = prompt is not None and self.tokenizer is not None and params.get("embed") is None
        if tokenized_here and buckets and cannot_fit(len(prompt or ""), max(buckets), self.max_token_chars):
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt of {len(prompt or '')} characters cannot fit the largest bucket served "
                f"({max(buckets)} tokens)",
            )
        request = build_request(prompt, input_ids, self.tokenizer, request_id, params)
        protocol.validate_request(request.to_wire())
        return request

    def _stream_of(self, request: Request, buckets: list[int]) -> str:
        """The request's stream (see :func:`target_stream`): an embedding keeps its text, and
        this client's tokenizer, where it has one, counts its tokens for the bucket."""
        length = None
        if request.embed is not None and request.prompt is not None and self.tokenizer is not None:
            # a long text is cut to the model's length anyway: the largest bucket, not a tokenizing
            # that would hold up an event loop
            long = len(request.prompt) > LONG_EMBED_CHARS
            length = max(buckets, default=0) if long else len(self.tokenizer.encode(request.prompt).ids)
        return target_stream(self.keys, request, buckets, length)

    def _queue_cancel(self, pipe: Any, request_id: str) -> None:
        """A cancel: the flag, for a worker that takes the request later, and the stream entry,
        for one running it now."""
        pipe.set(self.keys.cancel(request_id), 1, ex=CANCEL_TTL_S)
        pipe.xadd(self.keys.cancels, {"id": request_id}, maxlen=CANCELS_MAXLEN, approximate=True)


def adapter_records(raw: dict[bytes, bytes]) -> dict[str, AdapterRecord]:
    """The adapter registry's hash as records (an unreadable one left out: its adapter is unknown)."""
    records = {}
    for name, value in raw.items():
        with contextlib.suppress(ProtocolError):
            records[name.decode()] = AdapterRecord.from_json(name.decode(), value)
    return records
