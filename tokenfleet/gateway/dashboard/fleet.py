"""The dashboard's fleet view: workers, every stream's queue figures, the last hour's series.

Read from Redis alone in a few pipelined round trips, however many streams and workers there are
(the page polls it every couple of seconds).
"""

from __future__ import annotations

import time
from typing import Any

import redis

from tokenfleet.protocol import AUTO_BUCKET, GROUP, LANES, Keys, as_text
from tokenfleet.transport.registry import heartbeats
from tokenfleet.transport.series import read_series
from tokenfleet.transport.status import redis_memory


def overview(client: redis.Redis, keys: Keys, now: float | None = None) -> dict[str, Any]:
    """One fleet (prefix) at a glance: its workers' heartbeats, its queues, its dead letters and
    the last hour's throughput, TTFT and queue time."""
    now = time.time() if now is None else now
    buckets = sorted(int(b) for b in client.smembers(keys.buckets))
    return {
        "prefix": keys.prefix,
        "now": now,
        "redis": redis_memory(client),
        "workers": heartbeats(client, keys),
        "queues": queues(client, keys, buckets, now),
        "dead_letters": client.xlen(keys.dead_letter),
        "series": read_series(client, keys, now),
    }


def queues(client: redis.Redis, keys: Keys, buckets: list[int], now: float) -> list[dict[str, Any]]:
    """One row per bucket and lane (``auto`` included): waiting (no worker took them yet), pending
    (taken, not answered), the oldest waiting entry's age, and the same per shard stream."""
    names: list[int | str] = [*buckets, AUTO_BUCKET]
    rows = [(bucket, lane, keys.queue_streams(bucket, lane)) for lane in LANES for bucket in names]
    streams = [stream for _, _, row_streams in rows for stream in row_streams]
    figures = dict(zip(streams, _stream_figures(client, streams, now)))
    out = []
    for bucket, lane, row_streams in rows:
        parts = [{"stream": s, **figures[s]} for s in row_streams]
        ages = [p["oldest_waiting_s"] for p in parts if p["oldest_waiting_s"] is not None]
        out.append(
            {
                "name": keys.queue_name(bucket, lane),
                "bucket": bucket,
                "lane": lane,
                "waiting": sum(p["waiting"] for p in parts),
                "pending": sum(p["pending"] for p in parts),
                "entries": sum(p["entries"] for p in parts),
                "oldest_waiting_s": max(ages) if ages else None,
                "shards": [p for p in parts if p["entries"]],  # the busy ones; most are empty
            }
        )
    return out


def _stream_figures(client: redis.Redis, streams: list[str], now: float) -> list[dict[str, Any]]:
    """Per stream: entries (XLEN), waiting (the group's lag), pending and the oldest waiting age;
    two round trips for all of them."""
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
    replies = pipe.execute(raise_on_error=False)
    figures: list[dict[str, Any]] = []
    oldest = client.pipeline(transaction=False)
    for k in range(len(streams)):
        entries, groups = replies[2 * k], replies[2 * k + 1]
        entries = entries if isinstance(entries, int) else 0
        group = _workers_group(groups)
        if group is None:  # no worker ever read it: everything waits
            waiting, pending, after = entries, 0, "-"
        else:
            lag = group.get("lag")
            waiting = int(lag) if lag is not None else entries  # an upper bound after some trims
            pending, after = int(group["pending"]), "(" + as_text(group["last-delivered-id"])
        figures.append({"entries": entries, "waiting": waiting, "pending": pending})
        if waiting:
            oldest.xrange(streams[k], min=after, count=1)
    firsts = iter(oldest.execute())
    for figure in figures:
        first = next(firsts) if figure["waiting"] else []
        age = now - int(as_text(first[0][0]).split("-")[0]) / 1000 if first else None
        figure["oldest_waiting_s"] = round(age, 1) if age is not None else None
    return figures


def _workers_group(groups: Any) -> dict[Any, Any] | None:
    if not isinstance(groups, list):  # the stream does not exist
        return None
    return next((g for g in groups if as_text(g["name"]) == GROUP), None)
