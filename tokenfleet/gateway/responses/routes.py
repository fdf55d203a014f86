"""``/v1/responses``: create (whole, streamed or in the background), retrieve (whole or streamed
again from ``starting_after``), cancel, delete, and list a response's input items.

A response is one chat request on the fleet (``producer/openai/responses.py``); what the API
returns is folded from its reply stream (``producer/openai/response_output.py``), so any replica
answers for a response another one created, and a background response outlives the gateway that
took it and the worker that ran it (the queue's own guarantees).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from functools import partial
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

import tokenfleet.gateway.completions as completions
import tokenfleet.gateway.responses.store as store
import tokenfleet.gateway.webhooks.watch as watch
from tokenfleet.gateway.errors import APIError, api_error, reply_error
from tokenfleet.gateway.service import Service, caller_fields
from tokenfleet.gateway.streaming import START, CompletionProgress, follow, prepended
from tokenfleet.gateway.watch import orphaned_error
from tokenfleet.producer.base import reply_events
from tokenfleet.producer.openai.format import CLIENT_ERROR_CODES, Completion
from tokenfleet.producer.openai.response_output import Event
from tokenfleet.producer.openai.responses import ResponseBody, input_items, new_response_id, now
from tokenfleet.protocol import DEFAULT_REPLY_TTL_S, ErrorEvent, ReplyEvent

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create(body: ResponseBody, request: Request) -> JSONResponse | StreamingResponse:
    service: Service = request.app.state.service
    history = await _history(service, body.previous_response_id)
    default_max_tokens = service.config.default_max_tokens
    try:
        chat = body.chat_body(history, default_max_tokens)
    except ValueError as e:
        raise APIError(400, str(e)) from e
    response_id = new_response_id()
    kept = body.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"input"})
    record = store.ResponseRecord(
        response_id, kept, now(), history, input_items(body.input), Completion.of(response_id, "chat", chat)
    )
    ttl = service.config.responses_ttl_s if body.store else DEFAULT_REPLY_TTL_S
    if body.store:
        await service.responses.save(record, ttl)
    try:
        caller = caller_fields(request)
        timeout = watch.background_deadline_s(service) if body.background else None  # may wait long
        await completions.submit(
            service, "chat", chat, default_max_tokens, None, record.completion, ttl, caller, timeout
        )
    except Exception:
        await service.responses.delete(response_id)
        raise
    if body.background and service.config.webhook_urls:  # its end raises a webhook event
        await watch.open_response(service, response_id)
    if body.stream:
        return await _stream(service, record, -1, live=not body.background)
    if body.background:
        return JSONResponse({**record.fold().snapshot(), "status": "queued"})
    return await _whole(service, request, record, body.store)


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve(
    response_id: str,
    request: Request,
    stream: bool = False,
    starting_after: int | None = Query(None, ge=-1),
) -> JSONResponse | StreamingResponse:
    """The response now; streamed (a background one only), its events after ``starting_after``."""
    service: Service = request.app.state.service
    stored = await _load(service, response_id)
    if stream:
        if not stored.record.body.get("background"):
            raise APIError(400, "only a background response can be streamed again", param="stream")
        return await _stream(service, stored.record, -1 if starting_after is None else starting_after, False)
    if starting_after is not None:
        raise APIError(400, "starting_after needs stream=true", param="starting_after")
    return JSONResponse(await _current(service, stored))


@router.post("/v1/responses/{response_id}/cancel", response_model=None)
async def cancel(response_id: str, request: Request) -> JSONResponse:
    """Cancel a background response (one that has ended is returned as it is)."""
    service: Service = request.app.state.service
    stored = await _load(service, response_id)
    if not stored.record.body.get("background"):
        raise APIError(400, "only a background response can be cancelled", param="response_id")
    current = await _current(service, stored)
    if current["status"] in ("queued", "in_progress"):
        await service.responses.cancel(response_id)
        await completions.cancel(service, stored.record.completion)
        current["status"] = "cancelled"
    return JSONResponse(current)


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete(response_id: str, request: Request) -> JSONResponse:
    service: Service = request.app.state.service
    stored = await _load(service, response_id)
    await service.responses.delete(response_id)
    await service.client.redis.zrem(service.client.keys.open_responses, response_id)
    await completions.cancel(service, stored.record.completion)  # nothing to keep running for
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items", response_model=None)
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    before: str | None = None,
) -> JSONResponse:
    """The items the model was given (earlier turns' included; not the instructions)."""
    service: Service = request.app.state.service
    record = (await _load(service, response_id)).record
    items = [*record.history, *record.input]
    if order == "desc":
        items.reverse()
    ids = [item.get("id") for item in items]
    start = ids.index(after) + 1 if after in ids else 0
    end = ids.index(before) if before in ids else len(items)
    page = items[start:end][:limit]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    more = start + len(page) < end
    listed = {"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": more}
    return JSONResponse(listed)


async def _load(service: Service, response_id: str) -> store.Stored:
    stored = await service.responses.load(response_id)
    if stored is None:
        message = f"no response {response_id!r} (expired, deleted, created with store: false, or never made)"
        raise APIError(404, message, "invalid_request_error", "not_found", "response_id")
    return stored


async def _history(service: Service, previous: str | None) -> list[Any]:
    """The items of the turns before a response that continues ``previous``."""
    if previous is None:
        return []
    stored = await service.responses.load(previous)
    if stored is None:
        message = f"no previous response {previous!r} (expired, deleted, or created with store: false)"
        raise APIError(404, message, "invalid_request_error", "not_found", "previous_response_id")
    current = await _current(service, stored)
    if current["status"] in ("queued", "in_progress"):
        message = f"previous response {previous!r} has not ended yet"
        raise APIError(400, message, param="previous_response_id")
    return [*stored.record.history, *stored.record.input, *current["output"]]


async def _current(service: Service, stored: store.Stored) -> dict[str, Any]:
    """The response object now, from its reply stream (kept once it has ended)."""
    if stored.final is not None:
        return stored.final
    record = stored.record
    fold = record.fold()
    key = service.client.keys.reply_stream(record.completion.request_id(0))
    for _, event in reply_events(await service.client.redis.xrange(key)):
        fold.fold(event)
    response = fold.snapshot(stored.cancelled)
    if fold.ended:
        await service.responses.finish(record.id, response)
    return response


def _reply_events(
    service: Service, record: store.ResponseRecord
) -> AsyncGenerator[tuple[int, ReplyEvent], None]:
    """The response's reply events from the first, live until its terminal one."""
    lost = partial(orphaned_error, service.fleet, record.completion.model)
    progress = CompletionProgress([START])
    return follow(service.client, record.completion, progress, service.config.request_timeout_s, lost)


async def _whole(
    service: Service, request: Request, record: store.ResponseRecord, kept: bool
) -> JSONResponse:
    """Wait for the response's end; a client that goes away meanwhile cancels it."""
    fold = record.fold()

    async def run() -> None:
        async for _, event in _reply_events(service, record):
            fold.fold(event)

    work = asyncio.ensure_future(run())
    watcher = asyncio.create_task(completions.watch_disconnect(request, work))
    try:
        await work
    except asyncio.CancelledError:
        await completions.cancel(service, record.completion)
        raise APIError(499, "the client closed the request", code="cancelled") from None
    except Exception as e:
        await completions.cancel(service, record.completion)
        raise api_error(e) from e
    finally:
        watcher.cancel()
    if fold.error is not None and fold.error["code"] in CLIENT_ERROR_CODES:  # the request's fault
        raise reply_error(fold.error["code"], fold.error["message"])
    response = fold.snapshot()
    if kept:
        await service.responses.finish(record.id, response)
    return JSONResponse(response)


async def _stream(
    service: Service, record: store.ResponseRecord, starting_after: int, live: bool
) -> JSONResponse | StreamingResponse:
    """The response's events after ``starting_after`` as SSE (``live``: this client's own
    foreground response, cancelled if it goes away, and an error at once is an HTTP error)."""
    events = _reply_events(service, record)
    first: tuple[int, ReplyEvent] | None = None
    if live:  # its status waits for the first reply event: a prompt too long is a 400, as unstreamed
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            pass
        except Exception as e:  # past the retries, the timeout, no worker left: its error, not a 500
            await completions.cancel(service, record.completion)
            raise api_error(e) from e
        if first is not None and isinstance(first[1], ErrorEvent) and first[1].code in CLIENT_ERROR_CODES:
            await events.aclose()
            raise reply_error(first[1].code, first[1].message)

    async def body() -> AsyncIterator[bytes]:
        fold, ended = record.fold(), False
        try:
            for event in fold.opening():
                if event["sequence_number"] > starting_after:
                    yield _sse(event)
            async for _, reply in prepended(first, events):
                for event in fold.fold(reply):
                    if event["sequence_number"] > starting_after:
                        yield _sse(event)
            ended = True
        except Exception as e:  # past the retries, the request's timeout, no worker left
            error = api_error(e)
            yield _sse({"type": "error", "sequence_number": fold.sequence, **error.body()["error"]})
        finally:
            if not ended and live:  # the client went away from its own response
                service.spawn(completions.cancel(service, record.completion))
        if fold.ended and record.body.get("store", True):
            await service.responses.finish(record.id, fold.snapshot())

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _sse(event: Event) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
