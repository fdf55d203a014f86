"""The sync and asyncio clients are one API in two styles: the same methods with the same
parameters and defaults, and the same answers, here ``events(after=...)`` resuming a reply stream
part-way on a real Redis."""

from __future__ import annotations

import asyncio
import inspect
import threading

import pytest

from tokenfleet import protocol
from tokenfleet.producer import AsyncClient, AsyncHandle, Client, Handle
from tokenfleet.protocol import DoneEvent, Keys, TokenEvent

EVENTS = [TokenEvent(0, [5], "a"), TokenEvent(1, [6, 7], "bc"), TokenEvent(3, [8], "d")]
DONE = DoneEvent(finish_reason="length", prompt_tokens=3, completion_tokens=4)


def surface(cls: type) -> dict[str, object]:
    """Public methods (and ``__init__``) as their parameters' names, kinds and defaults; properties
    by name. Annotations differ by design (``Iterator`` / ``AsyncIterator``, ``Handle`` /
    ``AsyncHandle``)."""
    out: dict[str, object] = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, property):
            out[name] = "property"
        elif callable(member):
            params = inspect.signature(member).parameters.values()
            out[name] = [(p.name, p.kind, p.default) for p in params]
    return out


CLIENT_METHODS = {"buckets", "submit", "chat", "events", "stream", "result", "cancel", "close"}
HANDLE_METHODS = {"bucket", "events", "stream", "result", "cancel"}


@pytest.mark.parametrize(
    ("sync", "aio", "methods"),
    [(Client, AsyncClient, CLIENT_METHODS), (Handle, AsyncHandle, HANDLE_METHODS)],
)
def test_sync_and_async_classes_have_the_same_methods_and_signatures(sync, aio, methods):
    assert surface(sync) == surface(aio)
    assert methods <= surface(sync).keys()
    assert "after" in [name for name, _, _ in surface(sync)["events"]]


def _write(r, key: str, *events) -> None:
    for event in events:
        r.xadd(key, protocol.encode_event(event), id=event.stream_id)
    r.expire(key, 60)


def _seen(events) -> list[object]:
    return [e.index if isinstance(e, TokenEvent) else e.type for e in events]


def test_sync_events_after_an_entry_match_the_async_ones(r, redis_url, prefix):
    keys = Keys(prefix)
    _write(r, keys.reply_stream("resumed"), *EVENTS, DONE)
    after = EVENTS[0].stream_id  # resume past the first token event

    async def read_async() -> tuple[list[object], list[object]]:
        async with AsyncClient(redis_url, prefix=prefix) as client:
            shared = _seen([e async for e in client.events("resumed", 10, after=after)])
            handle = AsyncHandle(client, "resumed")
            first = client.events("resumed", 10)  # following it: the next reader reads on its own
            await first.__anext__()
            own = _seen([e async for e in handle.events(10, after=after)])
            await first.aclose()
            return shared, own

    with Client(redis_url, prefix=prefix) as client:
        shared = _seen(client.events("resumed", 10, after=after))
        first = client.events("resumed", 10)
        next(first)  # following it through the shared read: the next reader reads on its own
        own = _seen(Handle(client, "resumed").events(10, after=after))
        first.close()
        everything = _seen(client.events("resumed", 10))
    # past the first entry: the rest, whichever read serves it (event 1 carries tokens 1-2)
    assert shared == own == [1, 3, "done"]
    assert asyncio.run(read_async()) == (shared, own)
    assert everything == [0, 1, 3, "done"]


def test_sync_events_after_an_entry_follow_a_live_reply(r, redis_url, prefix):
    keys = Keys(prefix)
    key = keys.reply_stream("live")
    _write(r, key, EVENTS[0], EVENTS[1])
    got: list[object] = []
    with Client(redis_url, prefix=prefix) as client:
        events = client.events("live", 10, after=EVENTS[0].stream_id)
        got.append(_seen([next(events)])[0])  # what was there: index 1
        writer = threading.Timer(0.2, _write, (r, key, EVENTS[2], DONE))
        writer.start()
        got += _seen(events)  # the rest, as it comes
        writer.join()
    assert got == [1, 3, "done"]
