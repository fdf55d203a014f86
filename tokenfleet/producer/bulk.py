"""Bulk jobs: a JSONL file of prompts through the fleet, results in input order, resumable.

Each input line is a JSON string (the prompt) or an object with ``prompt`` or ``input_ids`` and
any request parameters. Request ids are derived from the input's content and line number, so a
run interrupted at any point and started again reads back what the fleet already finished (or
is still running) instead of submitting it twice, and appends only what the output lacks.

``enqueue_batch`` runs the same as an RQ job, serialized as JSON (never pickle), for a user who
wants to fire it and fetch its status and output later with RQ's own tools.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenfleet.errors import RequestFailed

DEFAULT_WINDOW = 64


def read_inputs(path: str, defaults: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every line of a JSONL input, each checked against the protocol before anything is
    submitted (a bad line found halfway would leave earlier requests running with no results
    written); raises ``ValueError`` naming ``file:line``."""
    from tokenfleet import protocol
    from tokenfleet.errors import ProtocolError

    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from e
        item = {"prompt": item} if isinstance(item, str) else item
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{n}: expected a string or an object")
        try:  # the id is ours (derived from the line); every other field as a worker would check it
            protocol.validate_request({**(defaults or {}), **item, "id": "check"})
        except ProtocolError as e:
            raise ValueError(f"{path}:{n}: {e.message}") from e
        items.append(item)
    return items


def rq_queue(prefix: str) -> str:
    """The RQ queue of a fleet's bulk jobs: its prefix (``tokenfleet`` by default)."""
    return prefix


def batch_id(path: str) -> str:
    """Stable for the same input file content: the resume key."""
    return "batch-" + hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _done_lines(output: str) -> int:
    path = Path(output)
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    complete = 0
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            break  # a line cut by the interruption: rewritten below
        complete += 1
    if complete < len(lines):
        path.write_text("".join(line + "\n" for line in lines[:complete]))
    return complete


def run_batch(
    client: Any,
    input_path: str,
    output_path: str,
    defaults: dict[str, Any] | None = None,
    window: int = DEFAULT_WINDOW,
    progress: Callable[[int], object] | None = None,
    timeout: float | None = 3600,
) -> dict[str, int]:
    """Run every input line through ``client`` (a producer Client), writing results in input
    order; returns counts. ``progress(n)`` is called as results are written."""
    items = read_inputs(input_path, defaults)
    prefix = batch_id(input_path)
    start = _done_lines(output_path)
    if progress and start:
        progress(start)
    pending: deque[tuple[int, str]] = deque()
    counts = {"total": len(items), "skipped": start, "done": 0, "failed": 0}
    with open(output_path, "a") as out:

        def submit(i: int) -> None:
            request_id = f"{prefix}-{i}"
            if not client.redis.exists(client.keys.reply_stream(request_id)):
                item = {**(defaults or {}), **items[i]}
                prompt, input_ids = item.pop("prompt", None), item.pop("input_ids", None)
                item.pop("id", None)
                client.submit(prompt, input_ids=input_ids, request_id=request_id, **item)
            pending.append((i, request_id))

        def drain_one() -> None:
            i, request_id = pending.popleft()
            row: dict[str, Any] = {"index": i, "id": request_id}
            try:
                res = client.result(request_id, timeout=timeout)
                row.update(
                    text=res.text, token_ids=res.token_ids, finish_reason=res.finish_reason, usage=res.usage
                )
                counts["done"] += 1
            except RequestFailed as e:
                row.update(error={"code": e.code, "message": e.message})
                counts["failed"] += 1
            out.write(json.dumps(row) + "\n")
            out.flush()
            if progress:
                progress(1)

        for i in range(start, len(items)):
            submit(i)
            if len(pending) >= window:
                drain_one()
        while pending:
            drain_one()
    return counts


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
    import redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    read_inputs(input_path, defaults)
    queue = Queue(rq_queue(prefix), connection=redis.Redis.from_url(redis_url), serializer=JSONSerializer)
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
