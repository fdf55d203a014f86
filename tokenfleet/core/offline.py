"""Serve sequences through an engine core in this process, without Redis: the benches' and the
tests' driver, the counterpart of vLLM's offline ``LLM.generate``. The worker loop drives the same
core through the same calls, with Redis on either side."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tokenfleet.core.interface import EngineCore, StepOutput, TokenOutput
from tokenfleet.core.sequence import SeqState


@dataclass(frozen=True)
class OfflineRun:
    """How long a run took, and the sequences that failed alone (each with why) instead of finishing."""

    seconds: float
    failed: list[tuple[SeqState, str]]


def run_offline(
    core: EngineCore,
    arrivals: Sequence[tuple[float, SeqState]],
    on_token: Callable[[TokenOutput], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_step: Callable[[StepOutput], None] | None = None,
) -> OfflineRun:
    """Add each sequence when its time comes (seconds after the start, in order) and step until
    every one has finished or failed; returns the wall time and the failures. ``on_token`` sees
    every token, ``on_step`` every step's output (a bench's view of the batches). A sequence the
    core refuses raises ``ValueError``: a benchmark's workload must fit the core it measures."""
    start = clock()
    nxt, left = 0, len(arrivals)
    failed: list[tuple[SeqState, str]] = []
    while left:
        now = clock()
        while nxt < len(arrivals) and start + arrivals[nxt][0] <= now:
            refusal = core.add(arrivals[nxt][1], time.monotonic())
            if refusal is not None:
                raise ValueError(f"the core refused a sequence: {refusal.code}: {refusal.message}")
            nxt += 1
        if not core.has_work:
            wake = [start + arrivals[nxt][0]] if nxt < len(arrivals) else []
            ready = core.ready_at()
            if ready is not None:  # a batch forming under max_wait_ms (monotonic clock)
                wake.append(now + max(0.0, ready - time.monotonic()))
            time.sleep(max(0.0, min(wake, default=now + 0.001) - clock()))
            continue
        refused = core.open_parked()
        output = replace(core.step(), refused=refused)
        if on_step is not None:
            on_step(output)
        for out in output.tokens:
            if on_token is not None:
                on_token(out)
            left -= out.finished
        failed += output.failed + [(seq, f"{r.code}: {r.message}") for seq, r in output.refused]
        left -= len(output.failed) + len(output.refused)  # a row that failed alone never finishes
    return OfflineRun(clock() - start, failed)


def finished_in(run: OfflineRun) -> float:
    """A run's seconds where every sequence finished; ``RuntimeError`` naming the first failure
    otherwise (a benchmark's figures mean nothing when some of its sequences failed)."""
    if run.failed:
        seq, why = run.failed[0]
        raise RuntimeError(f"{len(run.failed)} sequence(s) failed, first {seq.request.id}: {why}")
    return run.seconds
