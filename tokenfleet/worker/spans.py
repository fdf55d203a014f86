"""A worker's spans of each traced request (one with a ``traceparent``), under the trace's
parent: ``queue`` (Redis took it to this worker starting it: the reply's ``queue_ms``) and
``admission`` (this worker taking it to starting it: the batch window, KV room) and ``prefill``
when its first token goes out, so a worker killed later has already sent them;
``decode`` and ``publish`` at its end. A request resumed elsewhere gets the next worker's spans
under the same parent."""

from __future__ import annotations

import time
from typing import Any

from tokenfleet.core.sequence import SeqState
from tokenfleet.tracing import Tracer


class RequestSpans:
    def __init__(self, tracer: Tracer | None, worker: str):
        self.tracer, self.worker = tracer, worker

    def started(self, seq: SeqState) -> None:
        parent = seq.request.traceparent
        if self.tracer is None or parent is None:
            return
        started = seq.started or time.time()
        first = seq.first_token_at or started
        attributes = self._attributes(seq)
        self.tracer.record("queue", parent, seq.enqueued_wall, started, attributes)
        self.tracer.record("admission", parent, min(seq.taken_at, started), started, attributes)
        prefill = {
            **attributes,
            "tokenfleet.prompt_tokens": len(seq.prompt_ids),
            "tokenfleet.cached_tokens": seq.cached_tokens,
            "tokenfleet.batch_size": seq.batch_size,
        }
        self.tracer.record("prefill", parent, started, first, prefill)

    def ended(self, seq: SeqState, error: str | None = None) -> None:
        parent = seq.request.traceparent
        if self.tracer is None or parent is None:
            return
        now = time.time()
        first = seq.first_token_at or now
        last = seq.last_token_at or first
        attributes = self._attributes(seq)
        decode = {
            **attributes,
            "tokenfleet.completion_tokens": len(seq.generated),
            "tokenfleet.mean_batch_size": seq.mean_batch_size,
            "tokenfleet.finish_reason": seq.finish_reason or "",
        }
        self.tracer.record("decode", parent, first, last, decode, error)
        self.tracer.record("publish", parent, last, now, attributes, error)

    def _attributes(self, seq: SeqState) -> dict[str, Any]:
        return {
            "tokenfleet.request_id": seq.request.id,
            "tokenfleet.worker": self.worker,
            "tokenfleet.resumed_tokens": seq.resumed_tokens,  # above 0: another worker began it
        }
