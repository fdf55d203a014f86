"""``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /v1/requests/{id}``.

A completion of ``n`` choices is ``n`` tokenfleet requests (per prompt). Streamed, its chunks are
SSE events in exactly OpenAI's shape (``data:`` lines only, which every client's parser reads);
a client that sends ``X-Tokenfleet-Resumable: 1`` also gets each event's ``id:``, to pick a
dropped stream up on any replica with ``Last-Event-ID``. Otherwise the gateway waits for every
choice's result. A client that goes away cancels its requests, unless it sent an
``Idempotency-Key``, ``X-Tokenfleet-Keep: 1`` or ``X-Tokenfleet-Resumable: 1`` (it means to
come back).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenfleet.gateway.errors import APIError, api_error, reply_error
from tokenfleet.gateway.models import resolve
from tokenfleet.gateway.service import Service, caller_fields
from tokenfleet.gateway.streaming import START, CompletionProgress, chunks, follow, parse_event_id, prepended
from tokenfleet.gateway.watch import orphaned_error, unless_orphaned
from tokenfleet.producer.openai.controls import decoder
from tokenfleet.producer.openai.format import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatBody,
    Completion,
    CompletionBody,
    Kind,
)
from tokenfleet.producer.result import Result
from tokenfleet.protocol import DEFAULT_REPLY_TTL_S, ErrorEvent, ReplyEvent

router = APIRouter()
DISCONNECT_POLL_S = 0.5


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionBody, request: Request) -> JSONResponse | StreamingResponse:
    return await serve(request, "text", body, COMPLETIONS_DEFAULT_MAX_TOKENS)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatBody, request: Request) -> JSONResponse | StreamingResponse:
    service: Service = request.app.state.service
    return await serve(request, "chat", body, service.config.default_max_tokens)


@router.get("/v1/requests/{completion_id}", response_model=None)
async def replay(
    completion_id: str, request: Request, stream: bool = False
) -> JSONResponse | StreamingResponse:
    """A completion again, from its reply streams, until they expire: streamed or whole."""
    service: Service = request.app.state.service
    completion = await service.records.load(completion_id)
    if completion is None:
        raise APIError(404, f"no completion {completion_id!r} (expired, or never made)", "not_found_error")
    progress = CompletionProgress([START] * completion.choices)
    if stream:
        ids = opted_in(request, "x-tokenfleet-resumable")
        return await stream_response(service, completion, progress, include_usage=True, keep=True, ids=ids)
    return await whole_response(service, request, completion, keep=True)


def opted_in(request: Request, header: str) -> bool:
    return request.headers.get(header, "").lower() in ("1", "true")


async def serve(
    request: Request, kind: Kind, body: CompletionBody | ChatBody, default_max_tokens: int
) -> JSONResponse | StreamingResponse:
    service: Service = request.app.state.service
    headers = request.headers
    idempotency_key = headers.get("idempotency-key")
    last_event_id = headers.get("last-event-id")
    resumable = bool(last_event_id) or opted_in(request, "x-tokenfleet-resumable")  # ids on its events
    keep = idempotency_key is not None or resumable or opted_in(request, "x-tokenfleet-keep")
    if last_event_id:  # a dropped stream, picked up here
        completion, positions = await resumed(service, last_event_id)
        progress = CompletionProgress(positions)
    else:
        caller = caller_fields(request)
        completion = await submit(service, kind, body, default_max_tokens, idempotency_key, caller=caller)
        progress = CompletionProgress([START] * completion.choices)
    if body.stream:
        return await stream_response(service, completion, progress, body.include_usage, keep, resumable)
    return await whole_response(service, request, completion, keep)


async def resumed(service: Service, last_event_id: str) -> tuple[Completion, list[str]]:
    try:
        completion_id, positions = parse_event_id(last_event_id)
    except ValueError as e:
        raise APIError(400, str(e), param="Last-Event-ID") from e
    completion = await service.records.load(completion_id)
    if completion is None or len(positions) != completion.choices:
        raise APIError(404, f"no completion {completion_id!r} to resume (expired?)", "not_found_error")
    return completion, positions


async def submit(
    service: Service,
    kind: Kind,
    body: CompletionBody | ChatBody,
    default_max_tokens: int,
    idempotency_key: str | None,
    completion: Completion | None = None,
    reply_ttl_s: int = DEFAULT_REPLY_TTL_S,
    caller: dict[str, Any] | None = None,
    timeout_s: float | None = None,
) -> Completion:
    """Enqueue the completion's requests (``completion``: under that id; a new one otherwise;
    ``caller``: the fields the HTTP request gives them, :func:`caller_fields`; ``timeout_s``:
    their deadline, else the gateway's), or attach to those an Idempotency-Key already made."""
    base, adapter = await resolve(service, body.model)
    await service.fleet.require(base)
    try:
        completion = completion or Completion.new(kind, body)
        deadline_ms = int((time.time() + (timeout_s or service.config.request_timeout_s)) * 1000)
        extra: dict[str, Any] = {"adapter": adapter} if adapter else {}
        if reply_ttl_s != DEFAULT_REPLY_TTL_S:
            extra["reply_ttl_s"] = reply_ttl_s
        extra.update(caller or {})
        submissions = completion.submissions(body, default_max_tokens, deadline_ms=deadline_ms, **extra)
    except ValueError as e:
        raise APIError(400, str(e)) from e
    if idempotency_key is not None:
        existing = await service.records.claim(idempotency_key, completion)
        if existing is not None:
            return existing
    await service.records.save(completion, reply_ttl_s)
    handles = []
    try:
        for request_id, args in submissions:
            handles.append(await service.client.submit(request_id=request_id, **args))
    except Exception as e:
        for handle in handles:
            await handle.cancel()
        if idempotency_key is not None:
            await service.records.release(idempotency_key)
        raise api_error(e) from e
    return completion


async def stream_response(
    service: Service,
    completion: Completion,
    progress: CompletionProgress,
    include_usage: bool,
    keep: bool,
    ids: bool,
) -> JSONResponse | StreamingResponse:
    """The SSE stream (``ids``: each event with its ``id:``); its status waits for the first event,
    so a request that fails at once (too long a prompt, say) gets its HTTP error rather than a
    200 with an error inside."""
    lost = partial(orphaned_error, service.fleet, completion.model)
    events = follow(service.client, completion, progress, service.config.request_timeout_s, lost)
    first: tuple[int, ReplyEvent] | None = None
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        pass
    except Exception as e:
        if not keep:
            await cancel(service, completion)
        raise api_error(e) from e
    if first is not None and isinstance(first[1], ErrorEvent):
        await events.aclose()  # stops following the other choices
        await cancel(service, completion)
        raise reply_error(first[1].code, first[1].message)

    async def body() -> AsyncIterator[bytes]:
        finished = False
        try:
            replies = prepended(first, events)
            async for chunk in chunks(service.client, completion, progress, replies, include_usage, ids):
                yield chunk
            finished = True
        finally:
            if not finished and not keep and progress.pending:  # the client went away
                service.spawn(cancel(service, completion))

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def whole_response(
    service: Service, request: Request, completion: Completion, keep: bool
) -> JSONResponse:
    """Every choice's result, as OpenAI's completion object."""
    results = await wait_results(service, request, completion, keep)
    return JSONResponse(completion.response(results, decoder(service.client.tokenizer)))


async def wait_results(
    service: Service, request: Request, completion: Completion, keep: bool
) -> list[Result]:
    """Wait for every choice's result; a client that goes away meanwhile cancels them."""
    timeout = service.config.request_timeout_s
    results = asyncio.gather(*(service.client.result(rid, timeout) for rid in completion.request_ids))
    watcher = None if keep else asyncio.create_task(watch_disconnect(request, results))
    try:
        done = await unless_orphaned(results, service.fleet, completion.model)
    except asyncio.CancelledError:
        await cancel(service, completion)
        raise APIError(499, "the client closed the request", code="cancelled") from None
    except Exception as e:
        if not keep:
            await cancel(service, completion)
        raise api_error(e) from e
    finally:
        if watcher is not None:
            watcher.cancel()
    return list(done)


async def watch_disconnect(request: Request, results: asyncio.Future[Any]) -> None:
    """Cancel ``results`` if the client goes away before they are done."""
    while not results.done():
        if await request.is_disconnected():
            results.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def cancel(service: Service, completion: Completion) -> None:
    with contextlib.suppress(Exception):  # best effort: the requests' deadlines end them anyway
        for request_id in completion.request_ids:
            await service.client.cancel(request_id)
