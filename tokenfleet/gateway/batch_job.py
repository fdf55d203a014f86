"""The RQ job of a Batch API batch: read its input file, run every line through the fleet with
the bulk machinery, write the output and error files in OpenAI's format, keep the batch's state
current for ``GET /v1/batches/<id>``. Plain JSON arguments; sync (an RQ worker runs it)."""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from typing import Any

from tokenfleet.errors import RequestFailed
from tokenfleet.gateway.webhooks.events import BATCH_ENDINGS
from tokenfleet.gateway.webhooks.outbox import Outbox
from tokenfleet.producer.bulk import BULK_LANE, Job, run_windowed
from tokenfleet.producer.openai.batch import EmbeddingLine, body_of_line, output_line
from tokenfleet.producer.openai.controls import decoder
from tokenfleet.producer.openai.embeddings import EMBEDDINGS, EmbeddingBody
from tokenfleet.producer.openai.format import CHAT_COMPLETIONS, Completion
from tokenfleet.producer.result import Result
from tokenfleet.protocol.codec import as_text

PROGRESS_EVERY_S = 1.0  # how often the batch's counts are written back while it runs


def run_openai_batch(
    redis_url: str,
    prefix: str,
    model: str | None,
    batch_id: str,
    embed_prefix: str | None = None,
    embed_model: str | None = None,
    notify: bool = False,
) -> dict[str, int]:
    """Run one batch; ``embed_prefix`` / ``embed_model``: the fleet of its ``/v1/embeddings``
    lines, where it is not the gateway's own (the gateway's ``--embed-prefix``); ``notify``:
    raise its ending's webhook event (the gateway that took it has endpoints)."""
    from tokenfleet.producer import Client

    with Client(redis_url, model=model, prefix=prefix) as client:
        embedding = Client(redis_url, model=embed_model, prefix=embed_prefix or prefix)
        try:
            return _run(client, embedding, batch_id)
        except Exception as e:  # the batch must end, not stay in_progress for ever
            error = {
                "code": "internal_error",
                "message": f"{type(e).__name__}: {e}",
                "param": None,
                "line": None,
            }
            BatchState(client.redis, client.keys.batch(batch_id)).update(
                status="failed", failed_at=_now(), errors={"object": "list", "data": [error]}
            )
            raise
        finally:
            embedding.close()
            if notify:
                _announce(client, batch_id)


def _announce(client: Any, batch_id: str) -> None:
    """Raise ``batch.<status>`` for a batch that has ended (once, however often it runs)."""
    status = BatchState(client.redis, client.keys.batch(batch_id)).load()["status"]
    if status in BATCH_ENDINGS:
        Outbox(client.redis, client.keys).emit(BATCH_ENDINGS[status], batch_id)


def _run(client: Any, embedding: Any, batch_id: str) -> dict[str, int]:
    """The batch's record and files live on ``client``; its requests go to ``embedding`` for an
    embeddings batch."""
    from tokenfleet.gateway.files import store

    state = BatchState(client.redis, client.keys.batch(batch_id))
    record = state.load()
    if record["status"] in ("completed", "failed", "cancelled"):
        return record["request_counts"]  # already ended (a rerun of a finished job)
    content = client.redis.hget(client.keys.file(record["input_file_id"]), "content")
    try:
        tenant = client.redis.hget(client.keys.batch(batch_id), "tenant")  # its lines are its creator's
        owner = {} if tenant is None else {"tenant": as_text(tenant)}
        jobs = parse(content, record["endpoint"], batch_id, client.adapters(), owner)
        submitter = embedding if record["endpoint"] == EMBEDDINGS else client
    except ValueError as e:
        state.update(status="failed", failed_at=_now(), errors={"object": "list", "data": [_error(e)]})
        return record["request_counts"]
    state.update(status="in_progress", in_progress_at=_now(), request_counts=_counts(len(jobs), 0, 0))
    outputs: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    stopping: list[bool] = []

    def stop() -> bool:
        """A cancel asked for (run_windowed then cancels what still runs)."""
        if not stopping and state.cancelled():
            stopping.append(True)
        return bool(stopping)

    def collect(i: int, outcome: list[Result] | RequestFailed) -> None:
        job = jobs[i]
        assert job.completion is not None
        line = output_line(i, str(job.custom_id), job.completion, outcome, decoder(client.tokenizer))
        (errors if isinstance(outcome, RequestFailed) else outputs).append(line)
        state.progress(_counts(len(jobs), len(outputs), len(errors)))

    run_windowed(submitter, jobs, collect, stop=stop, cancel_in_flight=True)
    state.update(status="finalizing", finalizing_at=_now())
    ended: dict[str, Any] = {"request_counts": _counts(len(jobs), len(outputs), len(errors))}
    if outputs:
        ended["output_file_id"] = store(
            client.redis, client.keys, f"{batch_id}_output.jsonl", "batch_output", _jsonl(outputs)
        )["id"]
    if errors:
        ended["error_file_id"] = store(
            client.redis, client.keys, f"{batch_id}_errors.jsonl", "batch_output", _jsonl(errors)
        )["id"]
    if stopping:  # what finished before the cancel is in the files
        ended.update(status="cancelled", cancelled_at=_now())
    else:
        ended.update(status="completed", completed_at=_now())
    state.update(**ended)
    return ended["request_counts"]


class LineError(ValueError):
    """A line that makes the whole file unusable (not JSON, no custom_id, another endpoint, a
    repeated custom_id): the batch fails, naming it."""

    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}")
        self.line = line


def parse(
    content: bytes | None,
    endpoint: str,
    batch_id: str,
    adapters: Collection[str] = (),
    extra: dict[str, Any] | None = None,
) -> list[Job]:
    """The input file's lines as jobs (a ``model`` among ``adapters`` names that adapter;
    ``extra``: fields of every request, e.g. the creator's ``tenant``); a line
    whose body is invalid becomes a job that fails alone, as with OpenAI. ``ValueError``
    (:class:`LineError`) for a file that cannot run."""
    if content is None:
        raise ValueError("the input file is gone (expired or deleted)")
    jobs: list[Job] = []
    seen: set[str] = set()
    for n, text in enumerate(content.decode("utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
            if not isinstance(line, dict) or "custom_id" not in line:
                raise ValueError("each line needs custom_id, method, url and body")
            if line.get("url") != endpoint:
                raise ValueError(f"url {line.get('url')} is not the batch's endpoint {endpoint}")
            if line["custom_id"] in seen:
                raise ValueError(f"custom_id {line['custom_id']!r} appears twice")
        except ValueError as e:
            raise LineError(n, str(e)) from e
        seen.add(line["custom_id"])
        name, custom_id = f"{batch_id}-{len(jobs)}", str(line["custom_id"])
        try:
            kind, body = body_of_line(line)
        except ValueError as e:  # this line's body: it fails alone, in the error file
            raw = line.get("body")
            body_model: dict[str, Any] = raw if isinstance(raw, dict) else {}
            model = str(body_model.get("model", ""))
            if endpoint == EMBEDDINGS:
                failed = EmbeddingLine(name, EmbeddingBody.model_construct(model=model, input=[]))
                jobs.append(Job([], custom_id, failed, invalid=f"line {n}: {e}"))
                continue
            completion = Completion(
                name, "chat" if endpoint == CHAT_COMPLETIONS else "text", model, 1, 1, _now()
            )
            jobs.append(Job([], custom_id, completion, invalid=f"line {n}: {e}"))
            continue
        if isinstance(body, EmbeddingBody):
            line_job = EmbeddingLine(name, body)
            try:
                jobs.append(Job(line_job.submissions(BULK_LANE, **(extra or {})), custom_id, line_job))
            except ValueError as e:  # an empty input: this line fails alone
                jobs.append(Job([], custom_id, line_job, invalid=f"line {n}: {e}"))
            continue
        completion = Completion.of(name, kind, body)  # type: ignore[arg-type]
        adapter: dict[str, Any] = {"adapter": body.model} if body.model in adapters else {}
        submissions = completion.submissions(body, lane=BULK_LANE, **adapter, **(extra or {}))
        jobs.append(Job(submissions, custom_id, completion))
    return jobs


class BatchState:
    """The batch's record in Redis, written as the job moves on."""

    def __init__(self, redis: Any, key: str):
        self.redis, self.key = redis, key
        self._written = 0.0

    def load(self) -> dict[str, Any]:
        raw = self.redis.hget(self.key, "record")
        if raw is None:
            raise ValueError(f"no batch at {self.key}")
        record: dict[str, Any] = json.loads(raw)
        return record

    def update(self, **fields: Any) -> None:
        record = self.load()
        if record["status"] == "cancelling" and fields.get("status") in ("in_progress", "finalizing"):
            fields.pop("status")  # a cancel asked for meanwhile stands
        record.update(fields)
        self.redis.hset(self.key, "record", json.dumps(record))

    def progress(self, counts: dict[str, int]) -> None:
        if time.monotonic() - self._written >= PROGRESS_EVERY_S:
            self._written = time.monotonic()
            self.update(request_counts=counts)

    def cancelled(self) -> bool:
        return bool(self.redis.hexists(self.key, "cancel"))


def _counts(total: int, completed: int, failed: int) -> dict[str, int]:
    return {"total": total, "completed": completed, "failed": failed}


def _error(e: Exception) -> dict[str, Any]:
    line = e.line if isinstance(e, LineError) else None
    return {"code": "invalid_input", "message": str(e), "param": None, "line": line}


def _now() -> int:
    return int(time.time())


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()
