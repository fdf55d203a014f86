"""Synchronous producer client."""

from __future__ import annotations

import contextlib
import queue
import time
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
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
from tokenfleet.producer.result import Chunk, Result, ResultBuilder
from tokenfleet.producer.routing import enqueue_args, queue_full_error
from tokenfleet.producer.thread_replies import ThreadedReplyReader
from tokenfleet.protocol import ReplyEvent
from tokenfleet.protocol.adapters import AdapterRecord
from tokenfleet.transport.server.connection import connect_client


class Client(ClientBase):
    """Submit prompts to a tokenfleet fleet and read their results.

    ``redis_url`` and ``prefix`` default to ``REDIS_URL`` and ``TOKENFLEET_PREFIX`` like the CLI.
    ``model`` is a local model directory whose tokenizer picks the bucket; without it prompts go
    to the ``auto`` stream and a worker tokenizes them.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        model: str | None = None,
        prefix: str | None = None,
        *,
        buckets: list[int] | None = None,
        client: redis.Redis | None = None,
    ):
        super().__init__(client or connect_client(redis_url_from_env(redis_url)), model, prefix, buckets)
        # every stream followed by one read on a thread of its own; on a Cluster (reply streams
        # on different slots, which one XREAD cannot span) each request reads its own
        self._cluster = isinstance(self.redis, redis.RedisCluster)
        self._replies = (
            None if self._cluster else ThreadedReplyReader(self.redis, self.keys, RECONNECT_GIVE_UP_S)
        )

    def buckets(self) -> list[int]:
        """Bucket sizes served by the fleet (announced by workers; cached for a few seconds)."""
        cached = self._cached_buckets()
        if cached is not None:
            return cached
        return self._remember_buckets(self.redis.smembers(self.keys.buckets))

    def adapters(self) -> dict[str, AdapterRecord]:
        """The LoRA adapters the fleet serves, by name (``tokenfleet lora add``, a worker's ``--lora``)."""
        return adapter_records(self.redis.hgetall(self.keys.adapters))

    def submit(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        request_id: str | None = None,
        **params: Any,
    ) -> Handle:
        """Enqueue one request; returns at once with a :class:`Handle`. Raises
        :class:`~tokenfleet.errors.QueueFull` when its bucket already holds ``max_queue`` waiting
        requests (set by the workers' ``--max-queue``).

        ``params``: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
        ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``presence_penalty``,
        ``frequency_penalty``, ``repetition_penalty``, ``logit_bias`` (token id -> bias),
        ``logprobs`` (top-k, 0-20), ``response_format`` (OpenAI's map, or a pydantic model class
        for its JSON schema), ``deadline_ms``, ``reply_ttl_s`` (see PROTOCOL.md).
        """
        buckets = self.buckets()
        request = self._prepare(prompt, input_ids, request_id, params, buckets)
        stream = self._stream_of(request, buckets)
        keys, args = enqueue_args(self.keys, stream, request)
        reply = self.keys.reply_stream(request.id)
        # one MULTI: the empty reply stream and the request exist together or not at all (on a
        # Cluster they live on different slots: two steps, the stream first)
        pipe = self.redis.pipeline(transaction=not self._cluster)
        mark_reply_stream(pipe, reply, request.reply_ttl_s)
        if self._cluster:  # a cluster pipeline cannot load a script: the enqueue goes on its own
            try:
                pipe.execute()
                enqueued = self._enqueue(keys=keys, args=args)
            except redis.ResponseError as e:
                enqueued = e
        else:
            self._enqueue(keys=keys, args=args, client=pipe)
            try:
                enqueued = pipe.execute(raise_on_error=False)[-1]
            except redis.ResponseError as e:  # EXECABORT: a command refused as queued (OOM)
                enqueued = e
        if isinstance(enqueued, redis.ResponseError):
            self._unmark(reply)
            raise queue_full_error(enqueued) or enqueued
        self._remember_submitted(request.id)
        return Handle(self, request.id, stream)

    def _unmark(self, reply: str) -> None:
        """Drop the reply stream a refused enqueue created (if still empty: an id used before
        keeps its replies)."""
        with contextlib.suppress(redis.ResponseError):  # an ACL without DEL: it expires
            if self.redis.xlen(reply) == 0:
                self.redis.delete(reply)

    def embed(
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
        """Each input's vector, in order, as float32 ``array`` objects (``np.asarray(vectors)`` is the
        matrix), from a fleet serving an embedding model (or a generation model's, pooling its own
        hidden states). ``inputs``: texts or token id lists; ``dimensions``: the first ones,
        normalised again; ``normalize``: as the model's config says unless given; ``truncate``:
        inputs longer than the model takes are cut as sentence-transformers cuts them (else
        refused); ``pooling``: ``mean`` or ``last`` on a generation model. ``params``:
        ``priority``, ``deadline_ms``, ``reply_ttl_s``. Raises
        :class:`~tokenfleet.errors.RequestFailed` for an input that fails."""
        spec = embed_spec(dimensions, normalize, truncate, pooling)
        handles: list[Handle] = []
        try:
            for call in embed_inputs(inputs):
                handles.append(self.submit(**call, embed=spec, **params))
            return [vector_or_raise(handle.result(timeout)) for handle in handles]
        except BaseException:  # no vectors are returned: the inputs still queued are not embedded
            for handle in handles:
                with contextlib.suppress(Exception):
                    handle.cancel()
            raise

    def chat(self, messages: list[dict[str, str]], *, request_id: str | None = None, **params: Any) -> Handle:
        """Enqueue a chat: OpenAI-style ``messages`` (``[{"role": "user", "content": "..."}]``),
        rendered by a worker with the model's chat template (generation prompt added); the
        model's end-of-turn token ends it. Same ``params`` as :meth:`submit`."""
        return self.submit(request_id=request_id, messages=messages, **params)

    def events(self, request_id: str, timeout: float | None = None, after: str = "0") -> Iterator[ReplyEvent]:
        """The request's reply events in order, live, until its terminal one, from the one past
        ``after`` (a reply-stream id: an event's ``stream_id``, to resume a dropped stream). Works
        for requests submitted elsewhere, earlier (until their reply TTL expires). Safe to call
        from many threads at once: one read follows every stream this client is streaming. Raises
        :class:`~tokenfleet.errors.ResultTimeout` when ``timeout`` seconds pass first, and
        :class:`~tokenfleet.errors.RequestFailed` ``lost`` where Redis lost part of the reply."""
        continuity = Continuity(request_id, from_start=after == "0")
        for event in self._events(self._following(request_id, timeout, after)):
            continuity.check(event)
            yield event

    def _events(self, follow: Following) -> Iterator[ReplyEvent]:
        if self._replies is None or self._replies.following(follow.key):  # Cluster, or a second reader
            yield from self._events_one_read_each(follow)
            return
        inbox = self._replies.follow(follow.key, follow.last)
        try:
            while not follow.ended:
                try:
                    entries = inbox.get(timeout=follow.wait_s())
                except queue.Empty:  # the deadline (wait_s raises past it), or a quiet stream: still there?
                    if follow.due():
                        follow.judge(self._exists(follow.key))
                    continue
                if isinstance(entries, BaseException):
                    raise entries
                yield from follow.arrived(entries)
        finally:
            self._replies.unfollow(follow.key)

    def _events_one_read_each(self, follow: Following) -> Iterator[ReplyEvent]:
        while not follow.ended:
            try:
                resp = self.redis.xread({follow.key: follow.last}, block=follow.block_ms())
            except (RedisConnectionError, RedisTimeoutError) as e:
                time.sleep(follow.failed(e))
                continue
            if not resp and follow.due():
                follow.judge(self._exists(follow.key))
            yield from follow.answer(resp)

    def _exists(self, key: str) -> bool | None:
        """Whether ``key`` exists; None while Redis is away."""
        try:
            return bool(self.redis.exists(key))
        except (RedisConnectionError, RedisTimeoutError):
            return None

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[Chunk]:
        """Token chunks as they arrive; raises :class:`RequestFailed` on an ``error`` event."""
        builder = ResultBuilder(request_id)
        for event in self.events(request_id, timeout):
            chunk = builder.add(event)
            if chunk is not None:
                yield chunk

    def result(self, request_id: str, timeout: float | None = None) -> Result:
        """Block until the request ends; its :class:`Result`, or :class:`RequestFailed`."""
        builder = ResultBuilder(request_id)
        for event in self.events(request_id, timeout):
            builder.add(event)
        return builder.result

    def cancel(self, request_id: str) -> None:
        """Cancel a request: if queued it never starts; if running it stops within one step (~5 ms
        when steps are shorter) and ends with ``done`` / finish reason ``cancelled``. Harmless on
        a finished request."""
        pipe = self.redis.pipeline(transaction=False)
        self._queue_cancel(pipe, request_id)
        pipe.execute()

    def close(self) -> None:
        if self._replies is not None:
            self._replies.close()
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Handle(HandleBase):
    """A submitted request."""

    def __init__(self, client: Client, request_id: str, stream: str | None = None):
        super().__init__(request_id, stream)
        self.client = client

    def stream(self, timeout: float | None = None) -> Iterator[Chunk]:
        return self.client.stream(self.id, timeout)

    def events(self, timeout: float | None = None, after: str = "0") -> Iterator[ReplyEvent]:
        return self.client.events(self.id, timeout, after)

    def result(self, timeout: float | None = None) -> Result:
        return self.client.result(self.id, timeout)

    def cancel(self) -> None:
        self.client.cancel(self.id)
