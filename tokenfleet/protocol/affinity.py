"""Prefix affinity: which shard of its bucket's stream a request goes to, so that the turns of one
conversation (or the lines of one job) reach the worker that holds their prefix in its KV cache.

The rule is part of the wire contract (docs/PROTOCOL.md, "Affinity"): a producer in any language
computes the same shard from the same request.
"""

from __future__ import annotations

import hashlib
from typing import Any

SHARDS = 16
"""Shard streams per bucket and lane. Live workers split them by rendezvous hashing; a worker with
nothing of its own to do reads the others' (work stealing)."""

PROMPT_KEY_BYTES = 256
"""Without a ``cache_key``, a text prompt's key is its first this many bytes (UTF-8)."""
IDS_KEY_TOKENS = 32
"""...and a tokenized prompt's, its first this many token ids."""
MAX_CACHE_KEY_LEN = 256


def affinity_key(body: dict[str, Any]) -> bytes:
    """The bytes a request's shard is hashed from, read off its wire map: ``cache_key`` when set
    (prefixed by the ``adapter``'s name when it names one); else the ``adapter`` alone, so that an
    adapter's traffic gathers on the workers that hold it; else, for ``messages``, every message
    up to and including the first ``user`` one (all turns of a chat share them, other chats do
    not); else the start of ``prompt`` or ``input_ids``; all of it after ``t:<tenant>\n`` where
    the request names its ``tenant``."""
    tenant = body.get("tenant")
    salt = b"t:" + str(tenant).encode() + b"\n" if tenant else b""  # a tenant's shards are its own
    return salt + _unsalted_key(body)


def _unsalted_key(body: dict[str, Any]) -> bytes:
    key, adapter = body.get("cache_key"), body.get("adapter")
    if key:
        return (b"a:" + str(adapter).encode() + b"\n" if adapter else b"") + b"k:" + str(key).encode()
    if adapter:
        return b"a:" + str(adapter).encode()
    messages = body.get("messages")
    if messages:
        parts = []
        for message in messages:
            parts.append(f"{message['role']}\n{message['content']}\n")
            if message["role"] == "user":
                break
        return b"m:" + "".join(parts).encode()
    ids = body.get("input_ids")
    if ids:
        return b"i:" + ",".join(str(int(t)) for t in ids[:IDS_KEY_TOKENS]).encode()
    return b"p:" + str(body.get("prompt") or "").encode()[:PROMPT_KEY_BYTES]


def shard_of(body: dict[str, Any]) -> int:
    """The shard (0 .. SHARDS-1): the first 4 bytes of the key's SHA-256, big-endian, mod SHARDS."""
    return int.from_bytes(hashlib.sha256(affinity_key(body)).digest()[:4], "big") % SHARDS


def rendezvous_owners(workers: list[str], shards: int, scope: str) -> dict[int, str]:
    """Which live worker owns each shard of ``scope`` (a bucket): highest random weight, with each
    worker's share capped at ``ceil(shards / len(workers))`` so that two workers split 16 shards
    8/8 rather than by chance. A worker joining or leaving moves its own shards and, through the
    cap, only a few others."""
    if not workers:
        return {}
    cap = -(-shards // len(workers))
    owned = dict.fromkeys(workers, 0)
    owners: dict[int, str] = {}
    for shard in range(shards):
        ranked = sorted(workers, key=lambda w: _weight(w, scope, shard), reverse=True)
        owner = next(w for w in ranked if owned[w] < cap)
        owned[owner] += 1
        owners[shard] = owner
    return owners


def _weight(worker: str, scope: str, shard: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{worker}|{scope}|{shard}".encode()).digest()[:8], "big")
