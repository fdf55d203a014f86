"""Which request streams are a worker's own and which it only steals from, from the heartbeats.

Each bucket's shard streams are split among the live workers serving that bucket by rendezvous
hashing (protocol.affinity); a worker reads its own shards, the bucket's unsharded stream and the
``auto`` stream first, and the other shards only for entries that waited there past the steal
delay (their owner is busy, draining or dead).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenfleet.protocol import LANES, Keys
from tokenfleet.protocol.affinity import SHARDS, rendezvous_owners


@dataclass(frozen=True)
class Assignment:
    """Per lane, highest first: the streams read first, and those only stolen from."""

    own: tuple[tuple[str, ...], ...]
    others: tuple[tuple[str, ...], ...]
    shards_owned: int  # per lane, over every bucket served


def live_servers(beats: Iterable[dict[str, Any]], bucket: int) -> list[str]:
    """Names of the live workers whose heartbeat lists ``bucket``."""
    return sorted(b["name"] for b in beats if b.get("alive") and bucket in b.get("buckets", []))


def assign(keys: Keys, me: str, buckets: Iterable[int], beats: Iterable[dict[str, Any]]) -> Assignment:
    """This worker's :class:`Assignment` over the buckets it serves, given every heartbeat (we
    count as live whatever ours says: a worker starting up owns its share at once)."""
    beats = list(beats)
    owners = {b: rendezvous_owners(sorted({*live_servers(beats, b), me}), SHARDS, str(b)) for b in buckets}
    own: list[tuple[str, ...]] = []
    others: list[tuple[str, ...]] = []
    owned = sum(owner == me for by_shard in owners.values() for owner in by_shard.values())
    for lane in LANES:
        mine = [keys.request_stream(b, lane) for b in owners]
        theirs: list[str] = []
        for b, by_shard in owners.items():
            for shard, owner in sorted(by_shard.items()):
                (mine if owner == me else theirs).append(keys.shard_stream(b, lane, shard))
        own.append((*mine, keys.auto_stream_of(lane)))
        others.append(tuple(theirs))
    return Assignment(tuple(own), tuple(others), owned)
