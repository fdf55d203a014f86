"""asyncio producer client: the same surface as :class:`tokenfleet.producer.Client`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from array import array
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenfleet.config import redis_url_from_env
from tokenfleet.producer.base import (
    RECONNECT_GIVE_UP_S,
    ClientBase,
    Continuity,
    Following,
    HandleBase,
    adapter_records,
    mark_reply_stream,
)
from tokenfleet.producer.embeddings import embed_inputs, embed_spec, vector_or_raise
from tokenfleet.producer.replies import ReplyReader
from tokenfleet.producer.result import Chunk, Result, ResultBuilder
from tokenfleet.producer.routing import enqueue_args, queue_full_error, result_timeout
from tokenfleet.protocol import ReplyEvent
from tokenfleet.protocol.adapters import AdapterRecord
from tokenfleet.transport.server.connection import connect_async_client

TOKENIZE_ASIDE_CHARS = 64 << 10  # longer prompts are tokenized on a thread (~10 ms of a core and up)


class AsyncClient(ClientBase):
    def __init__(
        self,
        redis_url: str | None = None,
        model: str | None = None,
        prefix: str | None = None,
        *,
        buckets: list[int] | None = None,
        client: aioredis.Redis | None = None,
    ):
        super().__init__(
            client or connect_async_client(redis_url_from_env(redis_url)), model, prefix, buckets
        )
        self._cluster = isinstance(self.redis, aioredis.RedisCluster)
        self._replies = None if self._cluster else ReplyReader(self.redis, self.keys, RECONNECT_GIVE_UP_S)

    async def buckets(self) -> list[int]:
        cached = self._cached_buckets()
        if cached is not None:
            return cached
        return self._remember_buckets(await self.redis.smembers(self.keys.buckets))

    async def adapters(self) -> dict[str, AdapterRecord]:
        """The LoRA adapters the fleet serves, by name (see :meth:`Client.adapters`)."""
        return adapter_records(await self.redis.hgetall(self.keys.adapters))

    async def submit(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        request_id: str | None = None,
        **params: Any,
    ) -> AsyncHandle:
        buckets = await self.buckets()
        if prompt is not None and self.tokenizer is not None and len(prompt) > TOKENIZE_ASIDE_CHARS:
            # a long prompt's tokenizing would hold up every other caller of this event loop
            request = await asyncio.to_thread(self._prepare, prompt, input_ids, request_id, params, buckets)
        else:
            request = self._prepare(prompt, input_ids, request_id, params, buckets)
        stream = self._stream_of(request, buckets)
        keys, args = enqueue_args(self.keys, stream, request)
        reply = self.keys.reply_stream(request.id)
        pipe = self.redis.pipeline(transaction=not self._cluster)  # see Client.submit
        mark_reply_stream(pipe, reply, request.reply_ttl_s)
        if self._cluster:
            try:
                await pipe.execute()
                enqueued = await self._enqueue(keys=keys, args=args)
            except ResponseError as e:
                enqueued = e
        else:
            await self._enqueue(keys=keys, args=args, client=pipe)
            try:
                enqueued = (await pipe.execute(raise_on_error=False))[-1]
            except ResponseError as e:  # EXECABORT: a command refused as queued (OOM)
                enqueued = e
        if isinstance(enqueued, ResponseError):
            with contextlib.suppress(ResponseError):  # see Client._unmark
                if await self.redis.xlen(reply) == 0:
                    await self.redis.delete(reply)
            raise queue_full_error(enqueued) or enqueued
        self._remember_submitted(request.id)
        return AsyncHandle(self, request.id, stream)

    async def embed(
        self,
        inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate: bool = True,
        pooling: str | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> list[array[float]]:
        """Each input's vector, in order (see :meth:`Client.embed`)."""
        spec = embed_spec(dimensions, normalize, truncate, pooling)
        handles: list[AsyncHandle] = []
        try:
            for call in embed_inputs(inputs):
                handles.append(await self.submit(**call, embed=spec, **params))
            results = await asyncio.gather(*(handle.result(timeout) for handle in handles))
            return [vector_or_raise(result) for result in results]
        except BaseException:  # no vectors are returned: the inputs still queued are not embedded
            for handle in handles:
                with contextlib.suppress(Exception):
                    await handle.cancel()
            raise

    async def chat(
        self, messages: list[dict[str, str]], *, request_id: str | None = None, **params: Any
    ) -> AsyncHandle:
        """Enqueue a chat (see :meth:`Client.chat`)."""
        return await self.submit(request_id=request_id, messages=messages, **params)

    async def events(
        self, request_id: str, timeout: float | None = None, after: str = "0"
    ) -> AsyncIterator[ReplyEvent]:
        """The request's reply events in order, until its terminal one, from the one past
        ``after`` (a reply-stream id: an event's ``stream_id``, to resume a dropped stream); raises
        :class:`~tokenfleet.errors.ResultTimeout` when ``timeout`` seconds pass first, and
        :class:`~tokenfleet.errors.RequestFailed` ``lost`` where Redis lost part of the reply."""
        continuity = Continuity(request_id, from_start=after == "0")
        async for event in self._events(self._following(request_id, timeout, after)):
            continuity.check(event)
            yield event

    async def _events(self, follow: Following) -> AsyncIterator[ReplyEvent]:
        # Cluster (reply streams on different slots), or this request already followed here (a
        # second reader of it): an XREAD of its own
        if self._replies is None or self._replies.following(follow.key):
            async for event in self._events_one_read_each(follow):
                yield event
            return
        inbox = await self._replies.follow(follow.key, follow.last)
        # one timer per request, not one per wait (a timer armed and cancelled for every event
        # was a quarter of the client's CPU per event): at the deadline it hands the inbox the
        # timeout, which ends a wait for entries as a connection error does
        loop = asyncio.get_running_loop()
        expiry = None
        if follow.deadline is not None:
            left_s = max(0.0, follow.deadline - time.monotonic())
            timed_out = result_timeout(follow.request_id, follow.timeout)
            expiry = loop.call_later(left_s, inbox.put_nowait, timed_out)
        # a quiet stream is looked at (Liveness): an empty list in the inbox says when
        ticker = loop.call_later(max(0.01, follow.liveness.wait_s()), inbox.put_nowait, [])
        try:
            while not follow.ended:
                follow.block_ms()  # raises past the deadline
                entries = await inbox.get()
                if isinstance(entries, BaseException):
                    raise entries
                if not entries:
                    if follow.due():
                        follow.judge(await self._exists(follow.key))
                    ticker = loop.call_later(max(0.01, follow.liveness.wait_s()), inbox.put_nowait, [])
                    continue
                for event in follow.arrived(entries):
                    yield event
        finally:
            ticker.cancel()
            if expiry is not None:
                expiry.cancel()
            self._replies.unfollow(follow.key)

    async def _events_one_read_each(self, follow: Following) -> AsyncIterator[ReplyEvent]:
        while not follow.ended:
            try:
                resp = await self.redis.xread({follow.key: follow.last}, block=follow.block_ms())
            except (RedisConnectionError, RedisTimeoutError) as e:
                await asyncio.sleep(follow.failed(e))
                continue
            if not resp and follow.due():
                follow.judge(await self._exists(follow.key))
            for event in follow.answer(resp):
                yield event

    async def _exists(self, key: str) -> bool | None:
        """Whether ``key`` exists; None while Redis is away."""
        try:
            return bool(await self.redis.exists(key))
        except (RedisConnectionError, RedisTimeoutError):
            return None

    async def stream(self, request_id: str, timeout: float | None = None) -> AsyncIterator[Chunk]:
        builder = ResultBuilder(request_id)
        async for event in self.events(request_id, timeout):
            chunk = builder.add(event)
            if chunk is not None:
                yield chunk

    async def result(self, request_id: str, timeout: float | None = None) -> Result:
        builder = ResultBuilder(request_id)
        async for event in self.events(request_id, timeout):
            builder.add(event)
        return builder.result

    async def cancel(self, request_id: str) -> None:
        """Cancel a request: if queued it never starts; if running it stops within one step (~5 ms
        when steps are shorter) and ends with ``done`` / finish reason ``cancelled``. Harmless on
        a finished request."""
        pipe = self.redis.pipeline(transaction=False)
        self._queue_cancel(pipe, request_id)
        await pipe.execute()

    async def close(self) -> None:
        if self._replies is not None:
            await self._replies.close()
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncHandle(HandleBase):
    """A submitted request."""

    def __init__(self, client: AsyncClient, request_id: str, stream: str | None = None):
        super().__init__(request_id, stream)
        self.client = client

    def stream(self, timeout: float | None = None) -> AsyncIterator[Chunk]:
        return self.client.stream(self.id, timeout)

    def events(self, timeout: float | None = None, after: str = "0") -> AsyncIterator[ReplyEvent]:
        return self.client.events(self.id, timeout, after)

    async def result(self, timeout: float | None = None) -> Result:
        return await self.client.result(self.id, timeout)

    async def cancel(self) -> None:
        await self.client.cancel(self.id)
