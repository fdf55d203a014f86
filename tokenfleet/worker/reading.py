"""How much new work a turn may read (no hoarding), and how long its read may block."""

from __future__ import annotations

import time

from tokenfleet.core.interface import EngineCore
from tokenfleet.transport.intake import StreamReader
from tokenfleet.worker.policy import read_budget

IDLE_BLOCK_MS = 500  # longest blocking read, so that a stop request is noticed promptly
FORMING_POLL_MS = 5  # while a batch waits for max_wait_ms: look for more requests this often


def budget(core: EngineCore, max_batch_size: int) -> tuple[int, ...]:
    """Entries each lane may read now (see :func:`~tokenfleet.worker.policy.read_budget`)."""
    running = [seq.request.lane for seq in core.running()]
    return read_budget(max_batch_size, running, core.waiting_in(0), core.num_waiting)


def block_ms(core: EngineCore, reader: StreamReader, lanes: tuple[int, ...]) -> int | None:
    """How long the read may block: not at all while a batch runs; while a batch forms, sleep
    here in short slices instead (Redis times blocked reads out on its own clock tick, tens of ms
    late); a bounded idle wait otherwise. ``lanes``: the read's budget."""
    if core.has_work or max(lanes) <= 0:
        return None
    ready = core.ready_at()
    if core.num_waiting:
        left = IDLE_BLOCK_MS / 1000 if ready is None else ready - time.monotonic()
        if left > 0:
            time.sleep(min(left, FORMING_POLL_MS / 1000))
        return None
    longest = reader.longest_block_ms(IDLE_BLOCK_MS)  # shorter while others' shards may wait
    if ready is None:
        return longest
    return min(longest, max(1, int((ready - time.monotonic()) * 1000) + 1))
