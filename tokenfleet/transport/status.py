"""The fleet as Redis sees it: live workers from their heartbeats, and per-bucket queues.

Reads Redis only (no worker is asked anything), so it works from any machine with access.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from tokenfleet.protocol import AUTO_BUCKET, GROUP, LANES, Keys
from tokenfleet.transport.registry import heartbeats


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _queue(client: redis.Redis, stream: str, now: float) -> dict[str, Any]:
    """Depth (undelivered), pending (delivered, not acknowledged) and the oldest waiting age."""
    if not client.exists(stream):
        return {"depth": 0, "pending": 0, "oldest_waiting_s": None}
    groups: list[dict[str, Any]] = client.xinfo_groups(stream)
    group = next((g for g in groups if _text(g["name"]) == GROUP), None)
    depth: int
    if group is None:
        depth, after = client.xlen(stream), "-"
        pending = 0
    else:
        after = "(" + _text(group["last-delivered-id"])
        lag = group.get("lag")
        # Redis cannot compute the lag after some trims: count what lies after the last delivery
        undelivered: Any = None if lag is not None else client.xrange(stream, min=after, count=100_000)
        depth = int(lag) if lag is not None else len(undelivered)
        pending = group["pending"]
    first: Any = client.xrange(stream, min=after, count=1) if depth else []
    oldest = now - int(_text(first[0][0]).split("-")[0]) / 1000 if first else None
    return {
        "depth": depth,
        "pending": pending,
        "oldest_waiting_s": round(oldest, 3) if oldest is not None else None,
    }


def fleet_status(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Live workers, each lane's per-bucket queues and the dead letters (``tokenfleet status --json``)."""
    now = time.time()
    workers = heartbeats(client, keys)
    buckets = sorted(int(b) for b in client.smembers(keys.buckets))
    names: list[int | str] = [*buckets, AUTO_BUCKET]
    queues = {
        keys.queue_name(b, lane): {
            "bucket": b,
            "lane": lane,
            **_queue(client, keys.request_stream(b, lane), now),
        }
        for lane in LANES
        for b in names
    }
    return {
        "prefix": keys.prefix,
        "workers": workers,
        "queues": queues,
        "dead_letters": client.xlen(keys.dead_letter),
    }
