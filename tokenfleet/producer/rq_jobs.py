"""A bulk job (:func:`tokenfleet.producer.bulk.run_batch`) as an RQ job on the fleet's own Redis,
for ``tokenfleet batch --enqueue`` and the gateway's Batch API: plain JSON arguments in, counts
out, serialized as JSON on both sides (RQ pickles by default: never here)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tokenfleet.producer.bulk import read_inputs, run_batch


def rq_queue(prefix: str) -> str:
    """The RQ queue of a fleet's bulk jobs: its prefix (``tokenfleet`` by default)."""
    return prefix


def prompt_exit_worker() -> Any:
    """RQ's ``Worker`` whose command channel's thread wakes every second instead of every 60 s:
    RQ 3 on redis-py 8 stops that thread with a join that waits out its whole sleep once the
    channel is unsubscribed (a ``--burst`` worker took a minute to exit after its last job)."""
    from rq import Worker

    class PromptExitWorker(Worker):
        def subscribe(self) -> None:  # RQ's own, but for the thread's sleep (RQ types the thread None)
            self.pubsub = self.connection.pubsub()
            self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
            thread = self.pubsub.run_in_thread(
                sleep_time=1.0, daemon=True, exception_handler=self._pubsub_exception_handler
            )
            self.pubsub_thread = thread  # type: ignore[assignment]

    return PromptExitWorker


def run_batch_job(
    redis_url: str,
    prefix: str,
    model: str | None,
    input_path: str,
    output_path: str,
    defaults: dict[str, Any],
) -> dict[str, int]:
    """The RQ job: plain JSON arguments in, counts out. Its progress goes to the RQ job's ``meta``
    and a cancel is asked for with :meth:`~tokenfleet.protocol.Keys.bulk_cancel` (the dashboard
    reads the one and sets the other)."""
    from rq import get_current_job

    from tokenfleet.producer import Client

    job = get_current_job()
    with Client(redis_url, model=model, prefix=prefix) as client:
        if job is None:  # called directly, not by an RQ worker
            return run_batch(client, input_path, output_path, defaults)
        watch = JobWatch(job, client.redis, client.keys.bulk_cancel(job.id))
        watch.counts["total"] = len(read_inputs(input_path, defaults))
        return run_batch(
            client, input_path, output_path, defaults, progress=watch.progress, stop=watch.cancelled
        )


class JobWatch:
    """A bulk job's progress written to its RQ job's ``meta`` and its cancel looked up, each at most
    every :data:`EVERY_S` (the cancel is a key of its own: RQ rewrites ``meta`` whole)."""

    EVERY_S = 1.0

    def __init__(self, job: Any, redis: Any, cancel_key: str):
        self.job, self.redis, self.cancel_key = job, redis, cancel_key
        self.counts = {"total": 0, "written": 0}
        self._saved = self._checked = float("-inf")
        self._cancel = False

    def progress(self, n: int) -> None:
        self.counts["written"] += n
        now = time.monotonic()
        if now - self._saved >= self.EVERY_S or self.counts["written"] >= self.counts["total"]:
            self._saved = now
            self.job.meta.update(self.counts)
            self.job.save_meta()

    def cancelled(self) -> bool:
        now = time.monotonic()
        if not self._cancel and now - self._checked >= self.EVERY_S:
            self._checked = now
            self._cancel = bool(self.redis.exists(self.cancel_key))
        return self._cancel


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
