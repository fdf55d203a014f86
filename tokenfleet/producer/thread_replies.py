"""One blocking XREAD, on a thread of its own, for every reply stream a sync client follows.

A web app streams each request from a thread of its own. Each of N threads reading its own
reply stream pays a Redis round trip, a reply to parse and a wake-up per worker step; on a host
shared with the worker that client CPU is taken from the model (32 threads streaming SmolLM2
took a fifth of the two cores a step needs). Here one reader thread follows every stream with
one XREAD and hands each thread its entries through a queue: one round trip per step, and the
threads only wake.

The asyncio client does the same on its event loop (:mod:`tokenfleet.producer.replies`, which
also explains the private wake-up stream that ends a blocked read when a stream is added).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from queue import SimpleQueue
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenfleet.producer.base import RETRY_S
from tokenfleet.producer.followed import Entries, FollowedStreams
from tokenfleet.producer.replies import WAKE_TTL_S
from tokenfleet.producer.routing import READ_BLOCK_MS
from tokenfleet.protocol import Keys

Inbox = SimpleQueue  # of Entries, or the exception that ended the reading


class ThreadedReplyReader:
    """Reads the reply streams being followed, on a daemon thread started by the first
    :meth:`follow` (it ends when nothing is followed), and puts each stream's entries, in order,
    in its follower's queue."""

    def __init__(self, redis: Any, keys: Keys, give_up_s: float, read_block_ms: int = READ_BLOCK_MS):
        self.redis = redis  # redis-py's client is thread-safe: the read takes a pool connection
        self.wake_key = keys.client_wake(uuid.uuid4().hex)
        self.give_up_s = give_up_s  # without a connection this long, followers get the error
        self.read_block_ms = read_block_ms
        self._lock = threading.Lock()  # guards everything below
        self._followed: FollowedStreams[Inbox[Entries | BaseException]] = FollowedStreams(self.wake_key)
        self._running = False
        self._closed = False
        self._pid = os.getpid()  # the process whose reader thread _running speaks of

    def follow(self, stream: str, after: str = "0") -> Inbox[Entries | BaseException]:
        """Start following ``stream`` past entry ``after``; returns the queue its entries (a list
        per read) arrive in, or the error that ended the reading."""
        inbox: Inbox[Entries | BaseException] = SimpleQueue()
        followed = self._followed
        with self._lock:
            if self._pid != os.getpid():  # a forked child (a pre-fork web server's worker): no reader here
                self._pid, self._running = os.getpid(), False
                followed.clear()
            followed.add(stream, after, inbox)
            if not self._running:
                self._running, followed.wake_sent = True, False
                threading.Thread(target=self._read_loop, name="tokenfleet-replies", daemon=True).start()
                return inbox
            wake, followed.wake_sent = not followed.wake_sent, True
        if wake:  # a read may be blocked without this stream: end it now (one wake-up per read)
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.xadd(self.wake_key, {"w": 1}, maxlen=1)
                pipe.expire(self.wake_key, WAKE_TTL_S)
                pipe.execute()
            except BaseException:
                with self._lock:
                    followed.wake_sent = False
                raise
        return inbox

    def following(self, stream: str) -> bool:
        with self._lock:
            return stream in self._followed

    def unfollow(self, stream: str) -> None:
        with self._lock:
            self._followed.remove(stream)

    def close(self) -> None:
        """Stop reading (the thread ends with its read in flight, within ``read_block_ms``) and
        drop the wake-up stream."""
        with self._lock:
            self._closed = True
            self._followed.clear()
        with contextlib.suppress(RedisConnectionError, RedisTimeoutError):  # else it expires
            self.redis.delete(self.wake_key)

    def _read_loop(self) -> None:
        outage_since: float | None = None
        followed = self._followed
        while True:
            with self._lock:
                if self._closed or not followed:
                    self._running = False
                    return
                streams = followed.to_read()
            try:
                reply = self.redis.xread(streams, block=self.read_block_ms)
            except (RedisConnectionError, RedisTimeoutError) as e:
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since > self.give_up_s:
                    self._fail_all(e)
                else:
                    time.sleep(RETRY_S)
                continue
            except Exception as e:  # refused (e.g. an ACL without the wake-up stream): no retry
                self._fail_all(e)
                continue
            outage_since = None
            with self._lock:
                followed.hand_over(reply)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            self._followed.fail_all(error)
