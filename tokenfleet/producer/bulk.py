"""Bulk jobs: a JSONL file of prompts through the fleet, results in input order, resumable.

Two input formats: tokenfleet's (each line a JSON string, the prompt, or an object with
``prompt``, ``input_ids`` or ``messages`` and any request field) and OpenAI's Batch API lines
(``custom_id``, ``method``, ``url``, ``body``), whose results are written in OpenAI's output
format. Request ids derive from the input's content and line number, so a run interrupted at any
point and started again reads back what the fleet already finished (or still runs) instead of
submitting it twice, and appends only what the output lacks.

:mod:`tokenfleet.producer.rq_jobs` runs the same as an RQ job.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis

from tokenfleet.errors import ProtocolError, QueueFull, RedisFull, RequestFailed
from tokenfleet.producer.openai.batch import EmbeddingLine
from tokenfleet.producer.openai.embeddings import EmbeddingBody, little_endian
from tokenfleet.producer.openai.format import Completion
from tokenfleet.producer.result import Result
from tokenfleet.protocol import ErrorCode

DEFAULT_WINDOW = 64
LOST_RETRIES = 3  # times a line whose request Redis lost is submitted again
REDIS_AWAY_S = 120.0  # a submit waits this long for an unreachable Redis before the job fails
BULK_LANE = "batch"  # bulk jobs queue behind interactive traffic unless their lines say otherwise


@dataclass(frozen=True)
class Job:
    """One input line: the requests it makes (id and submit arguments), in choice order."""

    requests: list[tuple[str, dict[str, Any]]]
    custom_id: str | None = None  # OpenAI's lines: the caller's own id, echoed in the output
    completion: Completion | EmbeddingLine | None = None  # OpenAI's lines: what the output is built from
    invalid: str | None = None  # why the line cannot run (it fails alone, in its place)


def read_inputs(path: str, defaults: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every line of a JSONL input, each checked before anything is submitted (a bad line found
    halfway would leave earlier requests running with no results written); raises ``ValueError``
    naming ``file:line``."""
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            items.append(_checked(item, defaults))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from e
    return items


def _checked(item: Any, defaults: dict[str, Any] | None) -> dict[str, Any]:
    from tokenfleet import protocol
    from tokenfleet.errors import ProtocolError
    from tokenfleet.producer.openai.batch import body_of_line

    item = {"prompt": item} if isinstance(item, str) else item
    if not isinstance(item, dict):
        raise ValueError("expected a string or an object")
    if "custom_id" in item:
        body_of_line(item)  # raises ValueError with pydantic's reason
        return item
    try:  # the id is ours (derived from the line); every other field as a worker would check it
        protocol.validate_request({**(defaults or {}), **item, "id": "check"})
    except ProtocolError as e:
        raise ValueError(e.message) from e
    return item


def jobs_of(
    items: list[dict[str, Any]], prefix: str, defaults: dict[str, Any] | None, adapters: Collection[str] = ()
) -> list[Job]:
    """Each line's requests, with ids ``<prefix>-<line>`` (and ``.<choice>`` for OpenAI's, whose
    ``model`` may name one of the fleet's ``adapters``)."""
    from tokenfleet.producer.openai.batch import body_of_line

    jobs = []
    for i, item in enumerate(items):
        if "custom_id" in item:
            kind, body = body_of_line(item)
            lane = (defaults or {}).get("priority")
            if isinstance(body, EmbeddingBody):
                line = EmbeddingLine(f"{prefix}-{i}", body)
                try:
                    jobs.append(Job(line.submissions(lane), str(item["custom_id"]), line))
                except ValueError as e:  # an empty input, or too many: this line fails alone
                    jobs.append(Job([], str(item["custom_id"]), line, invalid=str(e)))
                continue
            completion = Completion.of(f"{prefix}-{i}", kind, body)  # type: ignore[arg-type]
            adapter: dict[str, Any] = {"adapter": body.model} if body.model in adapters else {}
            submissions = completion.submissions(body, lane=lane, **adapter)
            jobs.append(Job(submissions, str(item["custom_id"]), completion))
        else:
            args = {**(defaults or {}), **item}
            args.pop("id", None)
            jobs.append(Job([(f"{prefix}-{i}", args)]))
    return jobs


def run_windowed(
    client: Any,
    jobs: Sequence[Job],
    on_result: Callable[[int, list[Result] | RequestFailed], None],
    window: int = DEFAULT_WINDOW,
    timeout: float | None = 3600,
    start: int = 0,
    stop: Callable[[], bool] = lambda: False,
    cancel_in_flight: bool = False,
) -> None:
    """Submit ``jobs[start:]`` (each request only if its reply stream does not exist yet) with at
    most ``window`` jobs in flight, and hand each job's results to ``on_result`` in input order.
    ``stop()`` is asked before each submit and after each result: once true (a cancelled batch),
    nothing more is submitted (nor retried), and with ``cancel_in_flight`` what runs is cancelled
    (it ends at once); without, it runs to its end."""
    pending: deque[int] = deque()
    refused: dict[int, RequestFailed] = {}  # lines that failed before running, by index
    stopped = False

    def stopping() -> bool:
        nonlocal stopped
        if not stopped and stop():
            stopped = True
            for i in pending if cancel_in_flight else ():
                for rid, _ in jobs[i].requests:
                    client.cancel(rid)
        return stopped

    def drain_one() -> None:
        i = pending.popleft()
        job = jobs[i]
        failure = refused.pop(i, None)
        for attempt in range(1, LOST_RETRIES + 2):
            if failure is not None:
                return on_result(i, failure)
            try:
                return on_result(i, [client.result(rid, timeout=timeout) for rid, _ in job.requests])
            except RequestFailed as e:
                if e.code != ErrorCode.LOST or attempt > LOST_RETRIES or stopped:
                    return on_result(i, e)
                # Redis lost it (restart, failover): the line goes again under fresh ids (a
                # worker may still write the lost attempt's events under the old ones)
                for rid, _ in job.requests:
                    client.cancel(rid)
                again = [(f"{rid}:again{attempt}", args) for rid, args in jobs[i].requests]
                job = replace(job, requests=again)
                failure = _submit(client, job)

    in_flight = 0  # requests, not lines: one embeddings line may hold 2048 of them
    for i in range(start, len(jobs)):
        if stopping():
            break
        failure = _submit(client, jobs[i])
        if failure is not None:
            refused[i] = failure
        pending.append(i)
        in_flight += max(1, len(jobs[i].requests))
        while pending and (len(pending) >= window or in_flight >= window):
            in_flight -= max(1, len(jobs[pending[0]].requests))
            drain_one()
    while pending:
        drain_one()
        stopping()


def _submit(client: Any, job: Job) -> RequestFailed | None:
    """:func:`_submit_once`, again while Redis is away or the queue is full (it skips what is
    already submitted): a bulk job waits for room, as backpressure means."""
    deadline, pause = time.monotonic() + REDIS_AWAY_S, 0.1
    while True:
        try:
            return _submit_once(client, job)
        except (QueueFull, RedisFull):
            time.sleep(pause)  # the fleet drains the queue: no deadline but the job's own
            pause = min(pause * 2, 5.0)
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def _submit_once(client: Any, job: Job) -> RequestFailed | None:
    """Submit a line's requests (those not yet on a reply stream); a line the client refuses
    (a field out of range, say) fails alone: what it already submitted is cancelled."""
    name = job.requests[0][0] if job.requests else str(job.custom_id)
    if job.invalid is not None:
        return RequestFailed(name, ErrorCode.INVALID_REQUEST, job.invalid)
    try:
        for request_id, args in job.requests:
            if not client.redis.exists(client.keys.reply_stream(request_id)):
                args = dict(args)
                prompt, input_ids = args.pop("prompt", None), args.pop("input_ids", None)
                client.submit(prompt, input_ids=input_ids, request_id=request_id, **args)
    except (ValueError, ProtocolError) as e:
        for request_id, _ in job.requests:
            client.cancel(request_id)
        code = e.code if isinstance(e, ProtocolError) else ErrorCode.INVALID_REQUEST
        return RequestFailed(name, code, e.message if isinstance(e, ProtocolError) else str(e))
    return None


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
    base64_vectors: bool = False,
    stop: Callable[[], bool] = lambda: False,
) -> dict[str, int]:
    """Run every input line through ``client`` (a producer Client), writing results in input
    order; returns counts. ``progress(n)`` is called as results are written; embeddings are
    written as JSON floats, or as base64 of their float32 bytes. ``stop()`` true: nothing more is
    submitted; what runs still ends and is written, so a rerun resumes after it."""
    from tokenfleet.producer.openai.batch import output_line
    from tokenfleet.producer.openai.controls import decoder

    jobs = jobs_of(read_inputs(input_path, defaults), batch_id(input_path), defaults, client.adapters())
    start = _done_lines(output_path)
    if progress and start:
        progress(start)
    counts = {"total": len(jobs), "skipped": start, "done": 0, "failed": 0}
    with open(output_path, "a") as out:

        def write(i: int, outcome: list[Result] | RequestFailed) -> None:
            job = jobs[i]
            counts["failed" if isinstance(outcome, RequestFailed) else "done"] += 1
            if job.completion is not None:
                row = output_line(i, str(job.custom_id), job.completion, outcome, decoder(client.tokenizer))
            else:
                row = _row(i, job.requests[0][0], outcome, base64_vectors)
            out.write(json.dumps(row) + "\n")
            out.flush()
            if progress:
                progress(1)

        run_windowed(client, jobs, write, window, timeout, start, stop)
    return counts


def _row(
    index: int, request_id: str, outcome: list[Result] | RequestFailed, base64_vectors: bool
) -> dict[str, Any]:
    row: dict[str, Any] = {"index": index, "id": request_id}
    if isinstance(outcome, RequestFailed):
        row["error"] = {"code": outcome.code, "message": outcome.message}
    elif outcome[0].embedding is not None:
        vector = outcome[0].embedding
        encoded = base64.b64encode(little_endian(vector)).decode() if base64_vectors else vector.tolist()
        row.update(embedding=encoded, usage=outcome[0].usage)
    else:
        res = outcome[0]
        row.update(text=res.text, token_ids=res.token_ids, finish_reason=res.finish_reason, usage=res.usage)
    return row
