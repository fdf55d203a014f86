"""``POST /v1/messages`` (Anthropic's Messages API, whole or streamed), for clients built on the
Anthropic SDK. A message is one chat
request on the fleet (``producer/anthropic/``); errors come in Anthropic's shape
(``gateway/errors.py`` answers every path under ``/v1/messages`` so)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from functools import partial

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

import tokenfleet.gateway.completions as completions
from tokenfleet.gateway.errors import APIError, anthropic_error, api_error, reply_error
from tokenfleet.gateway.service import Service, caller_fields
from tokenfleet.gateway.streaming import START, CompletionProgress, follow, prepended
from tokenfleet.gateway.watch import orphaned_error
from tokenfleet.producer.anthropic.messages import MessagesBody, content_blocks, message, new_message_id
from tokenfleet.producer.anthropic.stream import Event, MessageFold
from tokenfleet.producer.openai.format import ChatBody, Completion
from tokenfleet.protocol import ErrorEvent, ReplyEvent

router = APIRouter()


@router.post("/v1/messages", response_model=None)
async def create(body: MessagesBody, request: Request) -> JSONResponse | StreamingResponse:
    service: Service = request.app.state.service
    chat = _chat(body)
    message_id = new_message_id()
    completion = Completion.of(message_id, "chat", chat)
    caller = caller_fields(request)
    await completions.submit(service, "chat", chat, body.max_tokens, None, completion, caller=caller)
    if body.stream:
        return await _stream(service, completion, body.model)
    result = (await completions.wait_results(service, request, completion, keep=False))[0]
    blocks = content_blocks(message_id, completion, result.text, result.finish_reason or "stop")
    answer = message(
        message_id, body.model, blocks, result.finish_reason or "stop", result.stop, result.usage
    )
    return JSONResponse(answer)


def _chat(body: MessagesBody) -> ChatBody:
    try:
        return body.chat_body()
    except ValueError as e:
        raise APIError(400, str(e)) from e


async def _stream(service: Service, completion: Completion, model: str) -> StreamingResponse:
    """The SSE stream; its status waits for the first reply event, so a request refused at once
    is an HTTP error rather than a 200 with an error inside."""
    lost = partial(orphaned_error, service.fleet, completion.model)
    progress = CompletionProgress([START])
    events = follow(service.client, completion, progress, service.config.request_timeout_s, lost)
    first: tuple[int, ReplyEvent] | None = None
    try:
        with contextlib.suppress(StopAsyncIteration):
            first = await events.__anext__()
    except Exception as e:
        await completions.cancel(service, completion)
        raise api_error(e) from e
    if first is not None and isinstance(first[1], ErrorEvent):
        await events.aclose()
        raise reply_error(first[1].code, first[1].message)

    async def body() -> AsyncIterator[bytes]:
        fold, ended = MessageFold(completion.id, model, completion), False
        try:
            for event in fold.opening():
                yield _sse(event)
            async for _, reply in prepended(first, events):
                if isinstance(reply, ErrorEvent):
                    raise reply_error(reply.code, reply.message)
                for event in fold.fold(reply):
                    yield _sse(event)
            ended = True
        except Exception as e:  # an error reply, past the retries, the timeout, no worker left
            yield _sse(anthropic_error(api_error(e)))
        finally:
            if not ended:  # the client went away, or it failed: nothing to keep running for
                service.spawn(completions.cancel(service, completion))

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _sse(event: Event) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
