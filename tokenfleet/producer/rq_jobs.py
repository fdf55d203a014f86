"""A bulk job (:func:`tokenfleet.producer.bulk.run_batch`) as an RQ job on the fleet's own Redis,
for ``tokenfleet batch --enqueue`` and the gateway's Batch API: plain JSON arguments in, counts
out, serialized as JSON on both sides (RQ pickles by default: never here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenfleet.producer.bulk import read_inputs, run_batch


def rq_queue(prefix: str) -> str:
    """The RQ queue of a fleet's bulk jobs: its prefix (``tokenfleet`` by default)."""
    return prefix


def run_batch_job(
    redis_url: str,
    prefix: str,
    model: str | None,
    input_path: str,
    output_path: str,
    defaults: dict[str, Any],
) -> dict[str, int]:
    """The RQ job: plain JSON arguments in, counts out."""
    from tokenfleet.producer import Client

    with Client(redis_url, model=model, prefix=prefix) as client:
        return run_batch(client, input_path, output_path, defaults)


def enqueue_batch(
    redis_url: str,
    prefix: str,
    model: str | None,
    input_path: str,
    output_path: str,
    defaults: dict[str, Any],
    job_timeout: int = 24 * 3600,
) -> str:
    """Enqueue :func:`run_batch_job` on the fleet's RQ queue (:func:`rq_queue`, JSON serializer);
    every line is checked first. Returns the job id."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from tokenfleet.transport.server.connection import connect_server

    read_inputs(input_path, defaults)
    queue = Queue(rq_queue(prefix), connection=connect_server(redis_url), serializer=JSONSerializer)
    job = queue.enqueue(
        run_batch_job,
        args=(
            redis_url,
            prefix,
            model,
            str(Path(input_path).resolve()),
            str(Path(output_path).resolve()),
            defaults,
        ),
        job_timeout=job_timeout,
        result_ttl=7 * 24 * 3600,
    )
    return job.id
