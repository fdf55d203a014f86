"""Requests that must stop before the next step: cancelled, past their deadline, or queued past
``queue_timeout_s``. Stopped at once wherever they are in the core (blocks freed, a waiting one
never starts), each with its one terminal event."""

from __future__ import annotations

import time

from tokenfleet.core.interface import EngineCore
from tokenfleet.core.sequence import SeqState
from tokenfleet.protocol import ErrorCode, FinishReason
from tokenfleet.worker.publisher import Publisher


def expired(seq: SeqState, now_wall: float, queue_timeout_s: float | None) -> bool:
    """Past its own deadline, or waited longer than ``queue_timeout_s`` without starting."""
    deadline = seq.request.deadline_ms
    if deadline is not None and deadline <= now_wall * 1000:
        return True
    return (
        queue_timeout_s is not None and seq.started is None and now_wall - seq.enqueued_wall > queue_timeout_s
    )


def enforce_stops(
    core: EngineCore, publisher: Publisher, cancelled_ids: set[str], queue_timeout_s: float | None
) -> None:
    """Stop what was cancelled (``done``, finish reason ``cancelled``) or ran out of time
    (``deadline_exceeded``), running or not."""
    held = core.held()
    if not held:
        return
    now = time.time()
    cancelled = {seq.key for seq in held if seq.request.id in cancelled_ids}
    late = {seq.key for seq in held if seq.key not in cancelled and expired(seq, now, queue_timeout_s)}
    if not cancelled and not late:
        return
    for seq in core.abort(cancelled | late):
        if seq.key in cancelled:
            seq.finish_reason = FinishReason.CANCELLED
            publisher.finish(seq)
        else:
            where = "while running" if seq.started else "before the request started"
            publisher.fail(seq, ErrorCode.DEADLINE_EXCEEDED, f"the deadline passed {where}")
