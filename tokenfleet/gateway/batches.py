"""OpenAI's Batch API on the durable queue: ``POST /v1/batches`` keeps the batch in Redis and
enqueues an RQ job (JSON serializer) that runs its lines through the bulk machinery
(:func:`tokenfleet.producer.bulk.run_windowed`); any gateway replica or ``tokenfleet rq-worker``
runs it, once. Request ids derive from the batch id, so a job that dies is resumed by its rerun."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from tokenfleet.gateway.errors import APIError
from tokenfleet.gateway.files import FILE_TTL_S
from tokenfleet.gateway.service import Service, caller_fields
from tokenfleet.producer.openai.batch import ENDPOINTS
from tokenfleet.producer.rq_jobs import rq_queue

router = APIRouter()
TERMINAL = ("completed", "failed", "cancelled", "expired")
JOB = "tokenfleet.gateway.batch_job.run_openai_batch"
JOB_ID_PREFIX = "tokenfleet-"  # a batch's RQ job id: this, then the batch's id


class BatchBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


@router.post("/v1/batches")
async def create(body: BatchBody, request: Request) -> dict[str, Any]:
    service: Service = request.app.state.service
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    redis, keys = service.client.redis, service.client.keys
    if not await redis.exists(keys.file(body.input_file_id)):
        raise APIError(404, f"no file {body.input_file_id!r}", "not_found_error", param="input_file_id")
    now = int(time.time())
    batch_id = "batch_" + uuid.uuid4().hex
    record: dict[str, Any] = {
        "id": batch_id,
        "object": "batch",
        "endpoint": body.endpoint,
        "errors": None,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + 24 * 3600,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": body.metadata,
    }
    owner = {"tenant": tenant} if (tenant := caller_fields(request).get("tenant")) else {}
    await redis.hset(keys.batch(record["id"]), mapping={"record": json.dumps(record), **owner})
    await redis.expire(keys.batch(record["id"]), FILE_TTL_S)
    await asyncio.to_thread(_enqueue, service, record["id"])
    return record


@router.get("/v1/batches/{batch_id}")
async def retrieve(batch_id: str, request: Request) -> dict[str, Any]:
    return await _record(request.app.state.service, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel(batch_id: str, request: Request) -> dict[str, Any]:
    """Stop submitting, cancel what runs; the job ends the batch as ``cancelled``."""
    service: Service = request.app.state.service
    record = await _record(service, batch_id)
    if record["status"] in TERMINAL:
        raise APIError(409, f"batch {batch_id} is already {record['status']}", code="batch_finished")
    record.update(status="cancelling", cancelling_at=int(time.time()))
    redis = service.client.redis
    await redis.hset(service.client.keys.batch(batch_id), mapping={"record": json.dumps(record), "cancel": 1})
    return record


@router.get("/v1/batches")
async def listing(request: Request, limit: int = 20) -> dict[str, Any]:
    """The newest batches still kept (a scan of this fleet's batch keys)."""
    service: Service = request.app.state.service
    redis, keys = service.client.redis, service.client.keys
    records = []
    async for key in redis.scan_iter(match=keys.batch("*"), count=500):
        raw = await redis.hget(key, "record")
        if raw is not None:
            records.append(json.loads(raw))
    records.sort(key=lambda r: r["created_at"], reverse=True)
    data = records[: max(1, min(limit, 100))]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {
        "object": "list",
        "data": data,
        "first_id": first,
        "last_id": last,
        "has_more": len(records) > len(data),
    }


async def _record(service: Service, batch_id: str) -> dict[str, Any]:
    raw = await service.client.redis.hget(service.client.keys.batch(batch_id), "record")
    if raw is None:
        raise APIError(404, f"no batch {batch_id!r}", "not_found_error")
    record: dict[str, Any] = json.loads(raw)
    return record


def _enqueue(service: Service, batch_id: str) -> None:
    from rq import Queue
    from rq.serializers import JSONSerializer

    from tokenfleet.transport.server.connection import connect_server

    config = service.config
    connection = connect_server(config.redis.url)
    queue = Queue(rq_queue(config.redis.prefix), connection=connection, serializer=JSONSerializer)
    queue.enqueue(
        JOB,
        args=(
            config.redis.url,
            config.redis.prefix,
            config.model,
            batch_id,
            config.embed_prefix,
            config.embed_model,
            bool(config.webhook_urls),
        ),
        job_id=JOB_ID_PREFIX + batch_id,
        job_timeout=25 * 3600,
        result_ttl=7 * 24 * 3600,
    )
