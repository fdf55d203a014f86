"""The fleet as Redis sees it: live workers from their heartbeats, and per-bucket queues.

Reads Redis only (no worker is asked anything), so it works from any machine with access.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from tokenfleet.protocol import AUTO_BUCKET, GROUP, LANES, Keys, as_text
from tokenfleet.transport.registry import heartbeats
from tokenfleet.transport.server.memory import out_of_memory, read_memory_policy


def _queue(client: redis.Redis, stream: str, now: float) -> dict[str, Any]:
    """Depth (undelivered), pending (delivered, not acknowledged) and the oldest waiting age."""
    if not client.exists(stream):
        return {"depth": 0, "pending": 0, "oldest_waiting_s": None}
    groups: list[dict[str, Any]] = client.xinfo_groups(stream)
    group = next((g for g in groups if as_text(g["name"]) == GROUP), None)
    depth: int
    if group is None:
        depth, after = client.xlen(stream), "-"
        pending = 0
    else:
        after = "(" + as_text(group["last-delivered-id"])
        lag = group.get("lag")
        # Redis cannot compute the lag after some trims: count what lies after the last delivery
        undelivered: Any = None if lag is not None else client.xrange(stream, min=after, count=100_000)
        depth = int(lag) if lag is not None else len(undelivered)
        pending = group["pending"]
    first: Any = client.xrange(stream, min=after, count=1) if depth else []
    oldest = now - int(as_text(first[0][0]).split("-")[0]) / 1000 if first else None
    return {
        "depth": depth,
        "pending": pending,
        "oldest_waiting_s": round(oldest, 3) if oldest is not None else None,
    }


def queue_totals(client: redis.Redis, streams: list[str], now: float) -> dict[str, Any]:
    """One queue's figures over all its streams (a bucket's own and its shards): depths and
    pendings summed, the oldest waiting age the largest."""
    parts = [_queue(client, stream, now) for stream in streams]
    ages = [p["oldest_waiting_s"] for p in parts if p["oldest_waiting_s"] is not None]
    return {
        "depth": sum(p["depth"] for p in parts),
        "pending": sum(p["pending"] for p in parts),
        "oldest_waiting_s": max(ages) if ages else None,
    }


def lane_queues(client: redis.Redis, keys: Keys) -> dict[str, dict[str, int]]:
    """Per lane, the requests waiting (``lag``: no worker took them yet) and in flight
    (``pending``) over every bucket, shard and ``auto`` stream: what an autoscaler scales on."""
    status = fleet_status(client, keys, with_workers=False)
    totals = {lane: {"lag": 0, "pending": 0} for lane in LANES}
    for queue in status["queues"].values():
        totals[queue["lane"]]["lag"] += queue["depth"]
        totals[queue["lane"]]["pending"] += queue["pending"]
    return totals


def redis_memory(client: Any) -> dict[str, Any]:
    """The eviction policy and whether Redis is refusing writes now (out of memory)."""
    policy = read_memory_policy(client)
    full = policy.policy is not None and out_of_memory(client.info("memory"))
    return {**policy.as_dict(), "out_of_memory": full}


def fleet_status(client: redis.Redis, keys: Keys, with_workers: bool = True) -> dict[str, Any]:
    """Live workers, each lane's per-bucket queues and the dead letters (``tokenfleet status --json``)."""
    now = time.time()
    workers = heartbeats(client, keys) if with_workers else []
    buckets = sorted(int(b) for b in client.smembers(keys.buckets))
    names: list[int | str] = [*buckets, AUTO_BUCKET]
    queues = {
        keys.queue_name(b, lane): {
            "bucket": b,
            "lane": lane,
            **queue_totals(client, keys.queue_streams(b, lane), now),
        }
        for lane in LANES
        for b in names
    }
    return {
        "prefix": keys.prefix,
        "redis": redis_memory(client),
        "workers": workers,
        "queues": queues,
        "dead_letters": client.xlen(keys.dead_letter),
    }
