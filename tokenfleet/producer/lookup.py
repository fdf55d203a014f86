"""Whether a request id names anything at all, from Redis alone (the fleet itself is in
:mod:`tokenfleet.transport.registry`)."""

from __future__ import annotations

from typing import Any

import redis

from tokenfleet import protocol
from tokenfleet.protocol import Keys

SCAN_LIMIT = 10_000  # request stream entries looked through for an id (queued, not yet taken)


def request_exists(client: redis.Redis, keys: Keys, request_id: str) -> bool:
    """Whether ``request_id`` names a request: its reply stream or owner exists, or it waits on
    a request stream (the newest :data:`SCAN_LIMIT` entries of each are looked through)."""
    if client.exists(keys.reply_stream(request_id), keys.owner(request_id)):
        return True
    wanted = request_id.encode()
    for stream in client.scan_iter(match=keys.request_stream("*"), count=100):
        entries: Any = client.xrevrange(stream, count=SCAN_LIMIT)
        for _, fields in entries:
            if fields.get(b"id") == wanted:
                return True
            body = fields.get(protocol.BODY_FIELD)
            if body is not None and wanted in body:
                try:
                    if protocol.unpack(body).get("id") == request_id:
                        return True
                except (ValueError, AttributeError):
                    continue
    return False
