"""Webhook events kept in Redis until every endpoint has taken them.

Raising an event writes its body once (by its id: raised twice, it is kept once) and makes it due
now in ``{P}:webhooks:due``. A replica that delivers takes due events under a lease (their score
moves past the lease), so a replica that dies mid-delivery leaves them due again for another;
each attempt is counted in the event's hash, the endpoints that answered 2xx are remembered
(``ok:<digest>``) and skipped on the next try, and after :data:`MAX_ATTEMPTS` the event is given
up (``gave_up`` in its hash, kept for a look until it expires)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from tokenfleet.gateway.webhooks.events import event_body, event_id
from tokenfleet.protocol import Keys

EVENT_TTL_S = 3 * 24 * 3600
MAX_ATTEMPTS = 16  # backoff doubles from 1 s to an hour: about six hours in all
MAX_BACKOFF_S = 3600
EMIT = """
if redis.call('hsetnx', KEYS[1], 'body', ARGV[1]) == 0 then return 0 end
redis.call('expire', KEYS[1], ARGV[4])
redis.call('zadd', KEYS[2], ARGV[2], ARGV[3])
return 1
"""
LEASE = """
local due = redis.call('zrangebyscore', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, member in ipairs(due) do redis.call('zadd', KEYS[1], 'XX', ARGV[2], member) end
return due
"""


def endpoint_digest(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def backoff_s(attempts: int) -> float:
    return float(min(2 ** (attempts - 1), MAX_BACKOFF_S))


class Outbox:
    """Raise, lease and settle webhook events (a sync or an asyncio client: the calls return
    what the client's commands return, so async callers await them)."""

    def __init__(self, redis: Any, keys: Keys):
        self.redis, self.keys = redis, keys
        self._emit = redis.register_script(EMIT)
        self._lease = redis.register_script(LEASE)

    def emit(self, kind: str, object_id: str, created_at: int | None = None) -> Any:
        """Raise ``kind`` for ``object_id`` (once, however often it is called)."""
        ident = event_id(kind, object_id)
        body = event_body(kind, object_id, int(created_at or time.time()))
        keys = [self.keys.webhook(ident), self.keys.webhooks_due]
        return self._emit(keys=keys, args=[body, time.time(), ident, EVENT_TTL_S])

    def lease(self, zset: str, lease_s: float, count: int) -> Any:
        """Up to ``count`` members of ``zset`` due now, each leased for ``lease_s``."""
        now = time.time()
        return self._lease(keys=[zset], args=[now, now + lease_s, count])


async def settle(redis: Any, keys: Keys, ident: str, failed: list[str]) -> None:
    """After an attempt: ``failed`` holds the errors of the endpoints that did not take it."""
    key = keys.webhook(ident)
    if not failed:
        pipe = redis.pipeline(transaction=False)
        pipe.zrem(keys.webhooks_due, ident)
        pipe.hset(key, "delivered_at", int(time.time()))
        await pipe.execute()
        return
    attempts = int(await redis.hincrby(key, "attempts", 1))
    await redis.hset(key, "last_error", "; ".join(failed)[:500])
    if attempts >= MAX_ATTEMPTS:
        pipe = redis.pipeline(transaction=False)
        pipe.zrem(keys.webhooks_due, ident)
        pipe.hset(key, "gave_up", int(time.time()))
        await pipe.execute()
    else:
        await redis.zadd(keys.webhooks_due, {ident: time.time() + backoff_s(attempts)}, xx=True)
