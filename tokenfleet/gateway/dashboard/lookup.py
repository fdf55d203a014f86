"""One request looked up by id from Redis alone: where it is (queued, running on a worker, ended),
its timings and its reply so far, as the dashboard shows it."""

from __future__ import annotations

from typing import Any

import redis

from tokenfleet.errors import ProtocolError
from tokenfleet.producer.lookup import find_queued
from tokenfleet.protocol import GROUP, DoneEvent, ErrorEvent, Keys, TokenEvent, as_text, decode_event

REPLAY_LIMIT = 10_000  # reply events read for one lookup (a reply has one per few tokens)


def lookup(client: redis.Redis, keys: Keys, request_id: str) -> dict[str, Any]:
    """``request_id``'s state (``queued``, ``running``, ``done``, ``failed``, ``unknown``), the
    worker that holds or ended it, its timings and the reply's events so far (``last_id``: the
    event to follow on from)."""
    raw: Any = client.xrange(keys.reply_stream(request_id), count=REPLAY_LIMIT)
    events = [event_view(entry_id, fields) for entry_id, fields in raw]
    owner = client.get(keys.owner(request_id))
    cancelled = bool(client.exists(keys.cancel(request_id)))
    found: dict[str, Any] = {
        "id": request_id,
        "events": [e for e in events if e is not None],
        "last_id": as_text(raw[-1][0]) if raw else "0",
        "cancel_requested": cancelled,
        "ttl_s": client.ttl(keys.reply_stream(request_id)),
    }
    terminal = next((e for e in found["events"] if e["type"] in ("done", "error")), None)
    if terminal is not None:
        state = "done" if terminal["type"] == "done" else "failed"
        return {**found, "state": state, "worker": terminal.get("worker"), "result": terminal}
    if owner is not None:
        stream, _, entry_id = as_text(owner).partition(" ")
        return {**found, "state": "running", "stream": stream, "worker": _holder(client, stream, entry_id)}
    queued = find_queued(client, keys, request_id)
    if queued is not None:
        return {**found, "state": "queued", "stream": queued[0], "entry": queued[1], "worker": None}
    return {**found, "state": "unknown" if not raw else "queued", "worker": None}


def event_view(entry_id: Any, fields: Any) -> dict[str, Any] | None:
    """A reply entry as the page shows it (an embedding's vector by its size only); None for an
    event type from a newer release."""
    try:
        event = decode_event(fields)
    except ProtocolError as e:
        return {"id": as_text(entry_id), "type": "malformed", "message": str(e)}
    if isinstance(event, TokenEvent):
        token = {"type": "token", "index": event.index, "ids": event.ids, "text": event.text}
        return {"id": as_text(entry_id), **token}
    if isinstance(event, DoneEvent):
        view = {k: v for k, v in event.to_wire().items() if k != "embedding"}
        if event.embedding is not None:
            view["embedding_dimensions"] = len(event.embedding) // 4
        return {"id": as_text(entry_id), **view}
    if isinstance(event, ErrorEvent):
        return {"id": as_text(entry_id), **event.to_wire()}
    return None


def _holder(client: redis.Redis, stream: str, entry_id: str) -> str | None:
    """The consumer (worker) that holds ``entry_id`` on ``stream``, while one does."""
    try:
        rows: Any = client.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
    except redis.ResponseError:  # the stream or its group is gone
        return None
    return as_text(rows[0]["consumer"]) if rows else None
