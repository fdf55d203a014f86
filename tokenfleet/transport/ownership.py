"""Which entry a request id belongs to, and whether it was cancelled before anyone took it: one
round trip when a worker takes a request."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from tokenfleet.protocol import Keys
from tokenfleet.transport.intake import Entry


@dataclass(frozen=True)
class Ownership:
    """``duplicate_of``: the entry that owns the id, when it is another one (in flight or
    answered); ``cancelled``: the request's cancel flag is set."""

    duplicate_of: str | None
    cancelled: bool


def take_ownership(client: redis.Redis, keys: Keys, entry: Entry, request_id: str, ttl_s: int) -> Ownership:
    """Make ``entry`` the owner of ``request_id`` for as long as its replies live (the same entry
    redelivered after a crash owns it already), and read the request's cancel flag."""
    me = f"{entry.stream} {entry.entry_id}"
    pipe = client.pipeline(transaction=False)  # spans slots on a cluster: no transaction
    pipe.set(keys.owner(request_id), me, nx=True, ex=ttl_s)
    pipe.get(keys.owner(request_id))
    pipe.exists(keys.cancel(request_id))
    _, owner, cancelled = pipe.execute()
    owner_text = owner.decode() if owner is not None else me
    return Ownership(owner_text if owner_text != me else None, bool(cancelled))
