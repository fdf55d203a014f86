"""The fleet as Redis sees it: live workers from their heartbeats, and per-bucket queues.

Reads Redis only (no worker is asked anything), so it works from any machine with access.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from tokenfleet.producer.lookup import heartbeats
from tokenfleet.protocol import AUTO_BUCKET, GROUP, Keys


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _queue(client: redis.Redis, stream: str, now: float) -> dict[str, Any]:
    """Depth (undelivered), pending (delivered, not acknowledged) and the oldest waiting age."""
    if not client.exists(stream):
        return {"depth": 0, "pending": 0, "oldest_waiting_s": None}
    group = next((g for g in client.xinfo_groups(stream) if _text(g["name"]) == GROUP), None)
    if group is None:
        depth, after = client.xlen(stream), "-"
        pending = 0
    else:
        depth = group.get("lag")
        if depth is None:  # Redis could not compute the lag: count what lies after last delivery
            depth = len(client.xrange(stream, min="(" + _text(group["last-delivered-id"]), count=100_000))
        after = "(" + _text(group["last-delivered-id"])
        pending = group["pending"]
    first = client.xrange(stream, min=after, count=1) if depth else []
    oldest = now - int(_text(first[0][0]).split("-")[0]) / 1000 if first else None
    return {
        "depth": depth,
        "pending": pending,
        "oldest_waiting_s": round(oldest, 3) if oldest is not None else None,
    }


def fleet_status(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    now = time.time()
    workers = heartbeats(client, keys)
    buckets = sorted(int(b) for b in client.smembers(keys.buckets))
    queues = {str(b): _queue(client, keys.request_stream(b), now) for b in [*buckets, AUTO_BUCKET]}
    return {
        "prefix": keys.prefix,
        "workers": workers,
        "queues": queues,
        "dead_letters": client.xlen(keys.dead_letter),
    }


def format_status(status: dict[str, Any]) -> str:
    lines = [f"fleet {status['prefix']!r}: {sum(w['alive'] for w in status['workers'])} live worker(s)", ""]
    lines.append(
        f"{'worker':<28} {'state':<6} {'buckets':<16} {'engine':<7} {'device':<8} "
        f"{'running':>7} {'waiting':>7} "
        f"{'tok/s':>8} {'done':>7} {'KV used':>11}"
    )
    for w in status["workers"]:
        kv = f"{w.get('kv_blocks_used', 0)}/{w.get('kv_blocks_total', 0)}"
        served = ",".join(map(str, w.get("buckets", [])))
        lines.append(
            f"{w['name'][:28]:<28} {'alive' if w['alive'] else 'stale':<6} {served:<16} "
            f"{w.get('engine', 'native'):<7} {w.get('device', '?'):<8} "
            f"{w.get('running', 0):>7} {w.get('waiting', 0):>7} "
            f"{w.get('tokens_per_s', 0):>8} {w.get('finished', 0):>7} {kv:>11}"
        )
    lines += ["", f"{'bucket':<8} {'depth':>7} {'pending':>8} {'oldest waiting':>15}"]
    for bucket, q in status["queues"].items():
        oldest = "-" if q["oldest_waiting_s"] is None else f"{q['oldest_waiting_s']:.1f}s"
        lines.append(f"{bucket:<8} {q['depth']:>7} {q['pending']:>8} {oldest:>15}")
    lines += ["", f"dead letters: {status['dead_letters']}"]
    return "\n".join(lines)
