"""Server-sent events in OpenAI's chunk format, ``data:`` lines only as OpenAI sends them; for a
client that opts in, each also carries an ``id:`` that names the completion and where each of its
choices has got to on its reply stream. A client that reconnects with ``Last-Event-ID``, to any
replica, gets the rest with no gap and no repeat."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from tokenfleet.gateway.errors import api_error, reply_error
from tokenfleet.producer import AsyncClient
from tokenfleet.producer.openai.controls import decoder
from tokenfleet.producer.openai.format import Completion
from tokenfleet.protocol import TERMINAL_EVENT_ID, DoneEvent, ErrorEvent, ReplyEvent, TokenEvent, decode_event

START = "0"  # a reply stream's position before its first event


def event_id(completion: Completion, positions: list[str]) -> str:
    """``<completion id>/<position of choice 0>,<position of choice 1>,...``"""
    return f"{completion.id}/{','.join(positions)}"


def parse_event_id(value: str) -> tuple[str, list[str]]:
    """The completion id and positions of an ``id:`` this gateway sent; ``ValueError`` otherwise."""
    completion_id, sep, positions = value.partition("/")
    if not sep or not completion_id or not positions:
        raise ValueError(f"Last-Event-ID {value!r} is not one of this API's event ids")
    return completion_id, positions.split(",")


@dataclass
class CompletionProgress:
    """Where a streamed completion stands: each choice's position, whether it has begun (chat's
    first delta carries the role), and the usage of those that are done."""

    positions: list[str]
    usage: dict[int, DoneEvent] = field(default_factory=dict)

    @property
    def pending(self) -> list[int]:
        return [k for k, p in enumerate(self.positions) if p != TERMINAL_EVENT_ID]


async def follow(
    client: AsyncClient,
    completion: Completion,
    progress: CompletionProgress,
    timeout: float,
    until_lost: Callable[[], Awaitable[BaseException]] | None = None,
) -> AsyncGenerator[tuple[int, ReplyEvent], None]:
    """Every choice's events past its position, merged in arrival order; ``until_lost`` returns
    the error that ends them early (no worker serves the model any more)."""
    queue: asyncio.Queue[tuple[int, ReplyEvent | BaseException | None]] = asyncio.Queue()

    async def one(k: int) -> None:
        try:
            async for event in client.events(completion.request_id(k), timeout, after=progress.positions[k]):
                await queue.put((k, event))
            await queue.put((k, None))
        except BaseException as e:  # handed over, raised where the stream is read
            await queue.put((k, e))

    async def watch(lost: Callable[[], Awaitable[BaseException]]) -> None:
        await queue.put((-1, await lost()))

    tasks = [asyncio.create_task(one(k)) for k in progress.pending]
    watcher = None if until_lost is None else asyncio.create_task(watch(until_lost))
    try:
        for _ in range(len(tasks)):
            while True:
                k, item = await queue.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield k, item
    finally:
        for task in tasks if watcher is None else [*tasks, watcher]:
            task.cancel()


async def prepended(
    first: tuple[int, ReplyEvent] | None, rest: AsyncIterator[tuple[int, ReplyEvent]]
) -> AsyncIterator[tuple[int, ReplyEvent]]:
    """``first`` (an event already read to pick the response's status, if any), then ``rest``."""
    if first is not None:
        yield first
    async for item in rest:
        yield item


async def done_events(client: AsyncClient, completion: Completion, progress: CompletionProgress) -> None:
    """Read the ``done`` events of choices that ended before a resumed stream (for its usage)."""
    for k, position in enumerate(progress.positions):
        if position == TERMINAL_EVENT_ID and k not in progress.usage:
            key = client.keys.reply_stream(completion.request_id(k))
            for _, fields in await client.redis.xrange(key, min=TERMINAL_EVENT_ID, max=TERMINAL_EVENT_ID):
                event = decode_event(fields)
                if isinstance(event, DoneEvent):
                    progress.usage[k] = event


def sse(data: dict[str, Any] | str, event_id: str | None = None) -> bytes:
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    head = b"" if event_id is None else b"id: " + event_id.encode() + b"\n"
    return head + b"data: " + payload + b"\n\n"


async def chunks(
    client: AsyncClient,
    completion: Completion,
    progress: CompletionProgress,
    events: AsyncIterator[tuple[int, ReplyEvent]],
    include_usage: bool,
    ids: bool,
) -> AsyncIterator[bytes]:
    """The SSE body: a chunk per token event, a closing chunk per choice with its finish reason,
    the usage when asked, ``[DONE]`` (``ids``: each event with its resume id). An error after
    the first chunk ends the stream with an ``error`` event (OpenAI's clients raise it)."""
    begun = {k for k, p in enumerate(progress.positions) if p != START}
    decode = decoder(client.tokenizer)
    calls: dict[int, list[str]] = {}  # a tool call's text by choice: it goes out whole, at its end
    try:
        async for k, event in events:
            progress.positions[k] = event.stream_id
            ident = event_id(completion, progress.positions) if ids else None
            if isinstance(event, TokenEvent) and (
                k in calls or (k not in begun and completion.answers_with_calls(event.text))
            ):  # under tool_choice auto the answer's first character tells a call from text
                calls.setdefault(k, []).append(event.text)
            elif (
                isinstance(event, DoneEvent)
                and event.finish_reason == "stop"
                and (whole := completion.calls_in("".join(calls.get(k, [])))) is not None
            ):
                progress.usage[k] = event
                calls.pop(k, None)
                yield sse(completion.tool_call_chunk(k, whole), ident)
                yield sse(completion.chunk(k, "", [], first=False, finish="tool_calls"), ident)
                begun.add(k)
            elif isinstance(event, TokenEvent):
                chunk = completion.chunk(
                    k, event.text, event.ids, k not in begun, None, event.logprobs, decode
                )
                yield sse(chunk, ident)
                begun.add(k)
            elif isinstance(event, DoneEvent):
                progress.usage[k] = event
                if k in calls:  # a tool call cut short (length, a stop string): its text, as text
                    yield sse(completion.chunk(k, "".join(calls.pop(k)), [], first=k not in begun), ident)
                    begun.add(k)
                yield sse(
                    completion.chunk(k, "", [], first=k not in begun, finish=event.finish_reason), ident
                )
                begun.add(k)
            elif isinstance(event, ErrorEvent):
                yield sse(reply_error(event.code, event.message).body(), ident)
                break
    except Exception as e:  # a lost connection past the retries, the request's timeout
        yield sse(api_error(e).body())
    if include_usage and not progress.pending:
        await done_events(client, completion, progress)
        ident = event_id(completion, progress.positions) if ids else None
        yield sse(completion.usage_chunk(usage_of(completion, progress)), ident)
    yield sse("[DONE]")


def usage_of(completion: Completion, progress: CompletionProgress) -> dict[str, Any]:
    """The usage of a completion whose choices have all ended."""
    return completion.usage([progress.usage[k].usage for k in sorted(progress.usage)])
