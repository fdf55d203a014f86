"""``POST /v1/embeddings`` in OpenAI's shape: each input is one embedding request to the fleet that
serves the model (``--embed-prefix``; by default this gateway's own), the vectors come back as
JSON floats or, with ``encoding_format: base64``, as the float32 bytes the workers wrote."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenfleet.gateway.errors import APIError, api_error
from tokenfleet.gateway.service import Service
from tokenfleet.gateway.watch import unless_orphaned
from tokenfleet.producer import AsyncHandle, Result
from tokenfleet.producer.embeddings import embed_inputs

MAX_INPUTS = 2048  # OpenAI's limit per request
router = APIRouter()


class EmbeddingBody(BaseModel):
    """OpenAI's fields, and ``truncate`` (ours: inputs longer than the model takes are cut as
    sentence-transformers cuts them; false: refused). Anything else is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate: bool = True


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
    calls = _calls(body.input)
    spec: dict[str, Any] = {"truncate": body.truncate}
    if body.dimensions is not None:
        spec["dimensions"] = body.dimensions
    deadline_ms = int((time.time() + service.config.request_timeout_s) * 1000)
    handles: list[AsyncHandle] = []
    try:
        for call in calls:
            handles.append(await client.submit(**call, embed=spec, deadline_ms=deadline_ms))
        timeout = service.config.request_timeout_s
        work = asyncio.gather(*(handle.result(timeout) for handle in handles))
        results: list[Result] = await unless_orphaned(work, fleet, body.model)
    except asyncio.CancelledError:  # the client went away
        await _cancel(handles)
        raise
    except Exception as e:
        await _cancel(handles)
        raise api_error(e) from e
    return JSONResponse(_response(body, results))


def _calls(value: Any) -> list[dict[str, Any]]:
    if value == [] or value == [[]]:
        raise APIError(400, "input must not be empty", param="input")
    calls = embed_inputs(value)
    if len(calls) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(calls)} items; at most {MAX_INPUTS} allowed", param="input")
    return calls


def _response(body: EmbeddingBody, results: list[Result]) -> dict[str, Any]:
    data = []
    for index, result in enumerate(results):
        vector = result.embedding
        if vector is None:  # not an embedding fleet's answer
            raise APIError(500, "a worker answered without a vector", "api_error")
        if body.encoding_format == "base64":
            if vector.itemsize != 4:
                raise APIError(500, "vectors must be float32", "api_error")
            encoded: Any = base64.b64encode(_little_endian(vector)).decode()
        else:
            encoded = vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = sum(result.usage.get("prompt_tokens", 0) for result in results)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": body.model, "usage": usage}


def _little_endian(vector: Any) -> bytes:
    import sys

    if sys.byteorder == "little":
        return bytes(vector)
    swapped = vector[:]
    swapped.byteswap()
    return bytes(swapped)


async def _cancel(handles: list[AsyncHandle]) -> None:
    with contextlib.suppress(Exception):  # best effort: their deadlines end them anyway
        for handle in handles:
            await handle.cancel()
