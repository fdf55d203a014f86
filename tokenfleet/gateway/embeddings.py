"""``POST /v1/embeddings`` in OpenAI's shape: each input is one embedding request to the fleet that
serves the model (``--embed-prefix``; by default this gateway's own), the vectors come back as
JSON floats or, with ``encoding_format: base64``, as the float32 bytes the workers wrote."""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenfleet.gateway.errors import APIError, api_error
from tokenfleet.gateway.service import Service
from tokenfleet.gateway.watch import unless_orphaned
from tokenfleet.producer import AsyncHandle, Result
from tokenfleet.producer.openai.embeddings import EmbeddingBody

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingBody, request: Request) -> JSONResponse:
    service: Service = request.app.state.service
    fleet, client = service.embed_fleet, service.embed_client
    generating = fleet is not service.fleet and (
        body.model in await service.fleet.models() and body.model not in await fleet.models()
    )
    if not generating:
        await fleet.require(body.model)
    if generating or not await fleet.embeds(body.model):
        message = f"the model {body.model!r} generates text; /v1/embeddings needs an embedding model"
        raise APIError(400, message, param="model", code="model_not_embedding")
    try:
        calls = body.submissions()
    except ValueError as e:
        raise APIError(400, str(e), param="input") from e
    deadline_ms = int((time.time() + service.config.request_timeout_s) * 1000)
    handles: list[AsyncHandle] = []
    try:
        for call in calls:
            handles.append(await client.submit(**call, deadline_ms=deadline_ms))
        timeout = service.config.request_timeout_s
        work = asyncio.gather(*(handle.result(timeout) for handle in handles))
        results: list[Result] = await unless_orphaned(work, fleet, body.model)
        return JSONResponse(body.response(results))
    except asyncio.CancelledError:  # the client went away
        await _cancel(handles)
        raise
    except Exception as e:
        await _cancel(handles)
        raise api_error(e) from e


async def _cancel(handles: list[AsyncHandle]) -> None:
    for handle in handles:
        with contextlib.suppress(Exception):  # best effort: their deadlines end them anyway
            await handle.cancel()
