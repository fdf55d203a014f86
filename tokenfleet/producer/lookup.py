"""What a producer can learn of the fleet and of a request from Redis alone: which workers are
alive and which buckets they serve, and whether a request id names anything at all."""

from __future__ import annotations

import time
from typing import Any

import redis

from tokenfleet import protocol
from tokenfleet.protocol import AUTO_BUCKET, Keys

STALE_AFTER_S = 10.0  # a worker silent this long is not alive (heartbeats come every 2 s)
SCAN_LIMIT = 10_000  # request stream entries looked through for an id (queued, not yet taken)


def heartbeats(client: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """Every worker's last heartbeat, with ``name``, ``alive`` and ``seen_s_ago``."""
    now = time.time()
    beats = []
    for name, raw in sorted(client.hgetall(keys.workers).items()):
        try:
            beat = protocol.unpack(raw)
        except ValueError:
            continue
        if not isinstance(beat, dict):
            continue
        age = now - float(beat.get("seen", 0))
        name = name.decode() if isinstance(name, bytes) else str(name)
        beats.append({"name": name, "alive": age < STALE_AFTER_S, "seen_s_ago": round(age, 1), **beat})
    return beats


def serving_workers(client: redis.Redis, keys: Keys, bucket: int | str | None = None) -> list[str]:
    """Live workers that serve ``bucket`` (any live worker takes ``auto`` or ``None``)."""
    return [
        beat["name"]
        for beat in heartbeats(client, keys)
        if beat["alive"] and (bucket in (None, AUTO_BUCKET) or int(bucket) in beat.get("buckets", []))
    ]


def request_exists(client: redis.Redis, keys: Keys, request_id: str) -> bool:
    """Whether ``request_id`` names a request: its reply stream or owner exists, or it waits on
    a request stream (the newest :data:`SCAN_LIMIT` entries of each are looked through)."""
    if client.exists(keys.reply_stream(request_id), keys.owner(request_id)):
        return True
    wanted = request_id.encode()
    for stream in client.scan_iter(match=keys.request_stream("*"), count=100):
        for _, fields in client.xrevrange(stream, count=SCAN_LIMIT):
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
