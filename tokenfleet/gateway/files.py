"""OpenAI's Files API, for the Batch API's input and output files, kept in Redis: a hash per file
with its metadata and ``content``, expiring after a week like the longest reply."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response

from tokenfleet.gateway.errors import APIError
from tokenfleet.gateway.service import Service
from tokenfleet.protocol import MAX_REPLY_TTL_S, Keys

router = APIRouter()
FILE_TTL_S = MAX_REPLY_TTL_S


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def store(redis: Any, keys: Keys, filename: str, purpose: str, content: bytes) -> dict[str, Any]:
    """Keep a file (sync client, as the batch job runs); returns its File object."""
    pipe = redis.pipeline(transaction=False)
    meta = _queue_store(pipe, keys, filename, purpose, content)
    pipe.execute()
    return meta


def _queue_store(pipe: Any, keys: Keys, filename: str, purpose: str, content: bytes) -> dict[str, Any]:
    """Queue on ``pipe`` (sync or asyncio: the caller executes it) what keeps a new file, with
    its expiry; returns its File object."""
    meta = _meta(new_file_id(), filename, purpose, len(content))
    pipe.hset(keys.file(meta["id"]), mapping={"meta": json.dumps(meta), "content": content})
    pipe.expire(keys.file(meta["id"]), FILE_TTL_S)
    return meta


def _meta(file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": int(time.time()),
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "expires_at": int(time.time()) + FILE_TTL_S,
    }


@router.post("/v1/files")
async def upload(
    request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
) -> dict[str, Any]:
    service: Service = request.app.state.service
    if purpose != "batch":
        raise APIError(
            400, f"purpose must be 'batch' (the Batch API's input), got {purpose!r}", param="purpose"
        )
    limit = service.config.max_file_bytes
    content = await file.read(limit + 1)
    if len(content) > limit:
        raise APIError(413, f"file is larger than this gateway's limit of {limit} bytes", param="file")
    pipe = service.client.redis.pipeline(transaction=False)
    meta = _queue_store(pipe, service.client.keys, file.filename or "upload.jsonl", purpose, content)
    await pipe.execute()
    return meta


@router.get("/v1/files/{file_id}")
async def metadata(file_id: str, request: Request) -> dict[str, Any]:
    service: Service = request.app.state.service
    raw = await service.client.redis.hget(service.client.keys.file(file_id), "meta")
    if raw is None:
        raise _missing(file_id)
    meta: dict[str, Any] = json.loads(raw)
    return meta


@router.get("/v1/files/{file_id}/content")
async def content(file_id: str, request: Request) -> Response:
    service: Service = request.app.state.service
    data = await service.client.redis.hget(service.client.keys.file(file_id), "content")
    if data is None:
        raise _missing(file_id)
    return Response(data, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete(file_id: str, request: Request) -> dict[str, Any]:
    service: Service = request.app.state.service
    if not await service.client.redis.delete(service.client.keys.file(file_id)):
        raise _missing(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def _missing(file_id: str) -> APIError:
    return APIError(404, f"no file {file_id!r} (expired, deleted, or never uploaded)", "not_found_error")
