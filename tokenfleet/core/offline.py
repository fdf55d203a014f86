"""Serve sequences through an engine core in this process, without Redis: the benches' and the
tests' driver, the counterpart of vLLM's offline ``LLM.generate``. The worker loop drives the same
core through the same calls, with Redis on either side."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tokenfleet.core.interface import EngineCore, StepOutput, TokenOutput
from tokenfleet.core.sequence import SeqState


def run_offline(
    core: EngineCore,
    arrivals: Sequence[tuple[float, SeqState]],
    on_token: Callable[[TokenOutput], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_step: Callable[[StepOutput], None] | None = None,
) -> float:
    """Add each sequence when its time comes (seconds after the start, in order) and step until
    every one has finished; returns the wall time. ``on_token`` sees every token, ``on_step``
    every step's output (a bench's view of the batches). A sequence the core refuses raises
    ``ValueError``: a benchmark's workload must fit the core it measures."""
    start = clock()
    nxt, left = 0, len(arrivals)
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
        output = core.step()
        if on_step is not None:
            on_step(output)
        for out in output.tokens:
            if on_token is not None:
                on_token(out)
            left -= out.finished
    return clock() - start
