"""One blocking XREAD for every reply stream an asyncio client follows.

A client following N requests with N XREADs pays N round trips and N wake-ups per worker step
(a step adds one event to each of them); one XREAD over all N streams pays one of each. On a
machine shared with the worker that client CPU is taken from the model, and an API server that
proxies many requests through one client pays it per request.

A request that starts following while the read is blocked must not wait for the others' next
event: :meth:`ReplyReader.follow` adds an entry to the client's own wake-up stream, which the
blocked read includes, so the read returns at once and the next one includes the new stream.
Reply streams of a Redis Cluster live on different slots (one XREAD cannot span them): there
the client reads each stream on its own (see :class:`~tokenfleet.producer.aio.AsyncClient`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenfleet.producer.base import RETRY_S
from tokenfleet.producer.followed import Entries, FollowedStreams
from tokenfleet.producer.routing import READ_BLOCK_MS
from tokenfleet.protocol import Keys

WAKE_TTL_S = 3600  # a client that dies without closing leaves its wake-up stream this long
CANCEL_RETRY_S = 0.02  # how long close() waits for the read task to take a cancel before it repeats it


class Inbox:
    """What the read hands one follower, in order: lists of entries, or the error that ended the
    reading. One waiter at most (its follower), so a list and a future do what an
    :class:`asyncio.Queue` did with more bookkeeping per event (on a client streaming 32 requests
    token by token, every event passes through one)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Entries | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Entries | BaseException) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Entries | BaseException:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class ReplyReader:
    """Reads the reply streams being followed and hands each its entries, in order."""

    def __init__(self, redis: Any, keys: Keys, give_up_s: float, read_block_ms: int = READ_BLOCK_MS):
        self.redis = redis
        self.wake_key = keys.client_wake(uuid.uuid4().hex)
        self.give_up_s = give_up_s  # without a connection this long, followers get the error
        self.read_block_ms = read_block_ms  # longest wait of one read (a wake-up ends it sooner)
        self._followed: FollowedStreams[Inbox] = FollowedStreams(self.wake_key)
        self._task: asyncio.Task[None] | None = None

    async def follow(self, stream: str, after: str = "0") -> Inbox:
        """Start following ``stream`` past entry ``after``; entries arrive in the returned inbox
        (a list per read), or the connection error that ended the reading."""
        inbox = Inbox()
        followed = self._followed
        followed.add(stream, after, inbox)
        if self._task is None or self._task.done():
            followed.wake_sent = False
            self._task = asyncio.create_task(self._read_loop())
        elif not followed.wake_sent:  # a read may be blocked without this stream: end it now
            # One wake-up ends the read; the next read takes every stream followed by then, so
            # a burst of requests starting together sends one, not one each (nor opens a
            # connection each for it while the read holds its own)
            followed.wake_sent = True
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.xadd(self.wake_key, {"w": 1}, maxlen=1)
                pipe.expire(self.wake_key, WAKE_TTL_S)
                await pipe.execute()
            except BaseException:
                followed.wake_sent = False
                raise
        return inbox

    def following(self, stream: str) -> bool:
        return stream in self._followed

    def unfollow(self, stream: str) -> None:
        self._followed.remove(stream)

    async def close(self) -> None:
        if self._task is not None:
            # On Python 3.11 a cancel that lands as redis-py's send finishes is lost inside
            # asyncio.wait_for, and the read then blocks its full READ_BLOCK_MS: cancel again
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=CANCEL_RETRY_S)
            with contextlib.suppress(asyncio.CancelledError, RedisConnectionError, RedisTimeoutError):
                await self._task
        with contextlib.suppress(RedisConnectionError, RedisTimeoutError):  # else it expires
            await self.redis.delete(self.wake_key)

    async def _read_loop(self) -> None:
        outage_since: float | None = None
        followed = self._followed
        while followed:
            try:
                reply = await self.redis.xread(followed.to_read(), block=self.read_block_ms)
            except (RedisConnectionError, RedisTimeoutError) as e:
                followed.wake_sent = False
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since > self.give_up_s:
                    return followed.fail_all(e)
                await asyncio.sleep(RETRY_S)
                continue
            except Exception as e:  # refused (e.g. an ACL without the wake-up stream): no retry
                return followed.fail_all(e)
            outage_since = None
            followed.hand_over(reply)
