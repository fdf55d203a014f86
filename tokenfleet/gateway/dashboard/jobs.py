"""Bulk jobs as the dashboard shows them: the Batch API's batches (their records in Redis) and
``tokenfleet batch --enqueue`` jobs (RQ jobs on the fleet's queue, progress in their ``meta``);
each with its progress, its errors and a cancel."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from tokenfleet.gateway.batches import JOB_ID_PREFIX
from tokenfleet.gateway.dashboard.access import Refused
from tokenfleet.protocol import Keys, as_text

BATCH_API_TERMINAL = ("completed", "failed", "cancelled", "expired")
RQ_TERMINAL = ("finished", "failed", "stopped", "canceled")
BULK_JOB = "tokenfleet.producer.rq_jobs.run_batch_job"
LIST_LIMIT = 100
CANCEL_TTL_S = 7 * 24 * 3600  # as long as RQ keeps a finished job


def listing(client: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """The newest batches and bulk jobs of this fleet, newest first: those RQ still lists (at most
    :data:`LIST_LIMIT` per state), read without a scan of the keyspace."""
    if isinstance(client, redis.RedisCluster):  # RQ has no cluster support: the batches' records only
        names = [n for n in client.scan_iter(match=keys.batch("*"), count=500)][:LIST_LIMIT]
        rows = _batch_api(client, [as_text(n).rsplit(":", 1)[-1] for n in names], keys)
    else:
        ids = _rq_job_ids(client, keys)
        batch_ids = [i.removeprefix(JOB_ID_PREFIX) for i in ids if i.startswith(JOB_ID_PREFIX)]
        bulk_ids = [i for i in ids if not i.startswith(JOB_ID_PREFIX)]
        rows = [*_batch_api(client, batch_ids, keys), *_bulk_jobs(client, bulk_ids, keys)]
    rows.sort(key=lambda row: row["created_at"] or 0, reverse=True)
    return rows[:LIST_LIMIT]


def cancel(client: redis.Redis, keys: Keys, job_id: str) -> dict[str, Any]:
    """Cancel a batch (``batch_...``: nothing more is submitted, what runs is cancelled) or a bulk
    job (one that has not started never will; a running one submits nothing more and ends when
    what it submitted has). :class:`Refused` where it is unknown or already over."""
    if job_id.startswith("batch_"):
        return _cancel_batch(client, keys, job_id)
    return _cancel_bulk(client, keys, job_id)


def _batch_api(client: redis.Redis, batch_ids: list[str], keys: Keys) -> list[dict[str, Any]]:
    pipe = client.pipeline(transaction=False)
    for batch_id in batch_ids:
        pipe.hget(keys.batch(batch_id), "record")
    rows = []
    for raw in pipe.execute():
        if raw is None:  # expired
            continue
        record = json.loads(raw)
        counts = record.get("request_counts") or {}
        errors = (record.get("errors") or {}).get("data") or []
        rows.append(
            {
                "kind": "batch",
                "id": record["id"],
                "status": record["status"],
                "endpoint": record.get("endpoint"),
                "total": counts.get("total", 0),
                "completed": counts.get("completed", 0),
                "failed": counts.get("failed", 0),
                "created_at": record.get("created_at"),
                "errors": [e.get("message", "") for e in errors][:5],
                "error_file_id": record.get("error_file_id"),
                "cancellable": record["status"] not in (*BATCH_API_TERMINAL, "cancelling"),
            }
        )
    return rows


def _cancel_batch(client: redis.Redis, keys: Keys, batch_id: str) -> dict[str, Any]:
    raw = client.hget(keys.batch(batch_id), "record")
    if raw is None:
        raise Refused(404, f"no batch {batch_id!r}")
    record = json.loads(raw)
    if record["status"] in BATCH_API_TERMINAL:
        raise Refused(409, f"batch {batch_id} is already {record['status']}")
    record.update(status="cancelling", cancelling_at=int(time.time()))
    client.hset(keys.batch(batch_id), mapping={"record": json.dumps(record), "cancel": 1})
    return {"cancelled": batch_id, "status": record["status"]}


def _queue(client: redis.Redis, keys: Keys) -> Any:
    from rq import Queue
    from rq.serializers import JSONSerializer

    from tokenfleet.producer.rq_jobs import rq_queue

    return Queue(rq_queue(keys.prefix), connection=client, serializer=JSONSerializer)


def _rq_job_ids(client: redis.Redis, keys: Keys) -> list[str]:
    """The fleet's RQ jobs: queued, then the newest started, finished, failed and cancelled ones
    (registries read as they are: a viewer writes nothing, and RQ's cleanup is its workers' job)."""
    queue = _queue(client, keys)
    ids: list[str] = list(queue.get_job_ids(0, LIST_LIMIT))
    for registry in (
        queue.started_job_registry,
        queue.finished_job_registry,
        queue.failed_job_registry,
        queue.canceled_job_registry,
    ):
        ids += registry.get_job_ids(0, LIST_LIMIT - 1, desc=True, cleanup=False)
    return list(dict.fromkeys(ids))


def _bulk_jobs(client: redis.Redis, job_ids: list[str], keys: Keys) -> list[dict[str, Any]]:
    from rq.job import Job

    jobs = Job.fetch_many(job_ids, connection=client, serializer=_queue(client, keys).serializer)
    mine = [job for job in jobs if job is not None and job.func_name == BULK_JOB]
    pipe = client.pipeline(transaction=False)
    for job in mine:
        pipe.exists(keys.bulk_cancel(job.id))
    return [_bulk_row(job, bool(asked)) for job, asked in zip(mine, pipe.execute())]


def _bulk_row(job: Any, cancel_asked: bool) -> dict[str, Any]:
    status = _status(job, refresh=False)
    meta = job.meta or {}
    result = job.latest_result() if status in RQ_TERMINAL else None
    ended = getattr(result, "return_value", None)  # a finished job's counts
    counts: dict[str, Any] = ended if isinstance(ended, dict) else {}
    failure = (getattr(result, "exc_string", None) or "").strip().splitlines()
    args: list[Any] = list(job.args or ())
    return {
        "kind": "bulk",
        "id": job.id,
        "status": "cancelling" if cancel_asked and status not in RQ_TERMINAL else status,
        "endpoint": "tokenfleet batch",
        "input": args[3] if len(args) > 3 else None,
        "output": args[4] if len(args) > 4 else None,
        "total": counts.get("total", meta.get("total", 0)),
        "completed": counts.get("done", 0) + counts.get("skipped", 0) if counts else meta.get("written", 0),
        "failed": counts.get("failed", 0),
        "created_at": job.created_at.timestamp() if job.created_at else None,
        "errors": failure[-1:],
        "cancellable": status not in RQ_TERMINAL and not cancel_asked,
    }


def _cancel_bulk(client: redis.Redis, keys: Keys, job_id: str) -> dict[str, Any]:
    from rq.exceptions import NoSuchJobError
    from rq.job import Job

    if isinstance(client, redis.RedisCluster):
        raise Refused(409, "bulk jobs run on RQ, which has no Redis Cluster support")
    try:
        job = Job.fetch(job_id, connection=client, serializer=_queue(client, keys).serializer)
    except NoSuchJobError as e:
        raise Refused(404, f"no batch or bulk job {job_id!r}") from e
    status = _status(job, refresh=True)
    if job.func_name != BULK_JOB or status in RQ_TERMINAL:
        raise Refused(409, f"job {job_id} is {status}: nothing to cancel")
    if status in ("queued", "deferred", "scheduled"):
        job.cancel()  # it never starts
        return {"cancelled": job_id, "status": "canceled"}
    client.set(keys.bulk_cancel(job_id), 1, ex=CANCEL_TTL_S)  # the job looks within a second
    return {"cancelled": job_id, "status": "cancelling"}


def _status(job: Any, refresh: bool) -> str:
    status = job.get_status(refresh=refresh)
    return str(getattr(status, "value", status) or "unknown")  # RQ's JobStatus is a str enum
