"""The fleet registry: who serves what. Workers announce their buckets and queue limits and beat
a heartbeat every few seconds; producers and ``tokenfleet status`` read them back."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import redis
from redis.typing import EncodableT, FieldT

from tokenfleet import protocol
from tokenfleet.protocol import AUTO_BUCKET, Keys, parse_heartbeat
from tokenfleet.transport.series import add_sample


def heartbeats(client: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """Every worker's last heartbeat, with ``name``, ``alive`` and ``seen_s_ago``."""
    now = time.time()
    entries: dict[Any, Any] = client.hgetall(keys.workers)
    parsed = (parse_heartbeat(name, raw, now) for name, raw in sorted(entries.items()))
    return [beat for beat in parsed if beat is not None]


def serving_workers(client: redis.Redis, keys: Keys, bucket: int | str | None = None) -> list[str]:
    """Live workers that serve ``bucket`` (any live worker takes ``auto`` or ``None``)."""
    return [
        beat["name"]
        for beat in heartbeats(client, keys)
        if beat["alive"] and (bucket in (None, AUTO_BUCKET) or int(bucket) in beat.get("buckets", []))
    ]


class Registry:
    """One worker's entry in the registry."""

    def __init__(self, client: redis.Redis, keys: Keys, name: str):
        self.client = client
        self.keys = keys
        self.name = name

    def announce(self, buckets: Iterable[int], max_queue: dict[str, int | None]) -> None:
        """Add our buckets to the routing set and set each lane's queue limits given (lane name ->
        limit): the enqueue script refuses producers past them."""
        buckets = list(buckets)
        self.client.sadd(self.keys.buckets, *buckets)
        names: list[int | str] = [*buckets, AUTO_BUCKET]
        limits: dict[FieldT, EncodableT] = {
            self.keys.queue_name(b, lane): limit
            for lane, limit in max_queue.items()
            if limit is not None
            for b in names
        }
        if limits:
            self.client.hset(self.keys.max_queue, mapping=limits)

    def beat(self, state: dict[str, Any], sample: dict[str, float] | None = None) -> None:
        """Publish this worker's state (``seen`` is set here) and add ``sample``, what it did since
        the last beat, to the fleet's time series; one round trip."""
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.keys.workers, self.name, protocol.pack({**state, "seen": now}))
        add_sample(pipe, self.keys, sample or {}, now)
        pipe.execute()

    def leave(self) -> None:
        self.client.hdel(self.keys.workers, self.name)

    def live_buckets(self, own: Iterable[int]) -> list[int]:
        """Buckets served by live workers (``own`` included), sorted; ``{P}:buckets`` is brought
        in line on the way, so buckets of workers gone long ago stop drawing producers."""
        live = {
            int(b)
            for beat in heartbeats(self.client, self.keys)
            if beat["alive"]
            for b in beat.get("buckets", [])
        }
        live |= set(own)
        stale = {int(b) for b in self.client.smembers(self.keys.buckets)} - live
        pipe = self.client.pipeline(transaction=False)
        pipe.sadd(self.keys.buckets, *live)
        if stale:
            pipe.srem(self.keys.buckets, *stale)
        pipe.execute()
        return sorted(live)
