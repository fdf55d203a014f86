"""Whether a request id names anything at all, from Redis alone (the fleet itself is in
:mod:`tokenfleet.transport.registry`)."""

from __future__ import annotations

from typing import Any

import redis

from tokenfleet import protocol
from tokenfleet.protocol import Keys, as_text

SCAN_LIMIT = 10_000  # entries looked through per request stream for an id (queued, not yet taken)


def request_exists(client: redis.Redis, keys: Keys, request_id: str) -> bool:
    """Whether ``request_id`` names a request: its reply stream or owner exists, or it waits on
    a request stream (the newest :data:`SCAN_LIMIT` entries of each are looked through)."""
    if client.exists(keys.reply_stream(request_id), keys.owner(request_id)):
        return True
    return find_queued(client, keys, request_id) is not None


def find_queued(client: redis.Redis, keys: Keys, request_id: str) -> tuple[str, str] | None:
    """The request stream and entry id where ``request_id`` waits, among the newest
    :data:`SCAN_LIMIT` entries of every stream of the buckets served (shards, lanes and ``auto``
    included); None where it is not found."""
    wanted = request_id.encode()
    buckets = sorted(int(b) for b in client.smembers(keys.buckets))
    for stream in (s for lane in keys.lane_streams(buckets) for s in lane):
        entries: Any = client.xrevrange(stream, count=SCAN_LIMIT)
        for entry_id, fields in entries:
            if _names(fields, request_id, wanted):
                return as_text(stream), as_text(entry_id)
    return None


def _names(fields: dict[bytes, bytes], request_id: str, wanted: bytes) -> bool:
    if fields.get(b"id") == wanted:
        return True
    body = fields.get(protocol.BODY_FIELD)
    if body is None or wanted not in body:
        return False
    try:
        return bool(protocol.unpack(body).get("id") == request_id)
    except (ValueError, AttributeError):
        return False
