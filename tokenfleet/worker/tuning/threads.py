"""The worker's compute threads, re-measured while it serves.

A worker starts with a thread per CPU it may use (:mod:`tokenfleet.config.cpus`). When another
process takes one of those cores (a package install, a second worker, anything), every parallel
region waits at its barrier for the thread that shares its core: on 2 vCPUs a busy neighbour cut
a 2-thread worker to 0.28-0.37x of its speed alone, where 1 thread keeps about 0.55x.

The kernel says when that happens: the time our threads spent runnable but waiting for a CPU
(``/proc/self/task/*/schedstat``) is under 1% of their time alone and about a third beside a busy
neighbour. When it passes :data:`CONTENDED`, the worker tries one thread fewer on its next steps
of the same kind and size as the ones just timed (a prefill of as many tokens, or decode steps of
as many sequences), and keeps whichever count is clearly faster. Fewer threads leave the
neighbour its core, so the wait no longer shows: every :data:`PROBE_EVERY_S` the worker tries one
more, and takes the cores back once the neighbour has gone. Alone, nothing is tried.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenfleet.config.cpus import side_work_threads

log = logging.getLogger(__name__)

CONTENDED = 0.12  # share of their time our threads waited for a CPU: alone ~0.01, a busy neighbour ~0.35
LOOK_EVERY_S = 0.25  # how often that share is read (a few files per read)
PROBE_EVERY_S = 15.0  # with threads given up: how often one more is tried
RETRY_FEWER_S = 3.0  # fewer threads tried and not faster: how long before they are tried again
MIN_GAIN = 1.1  # a count is taken only when clearly faster: step times swing a few percent
SAME_SIZE = 0.125  # steps compare while their sizes are this close (continuous batching moves them)
STEPS = {"prefill": 1, "decode": 4}  # steps timed at each count (a prefill is long and steady)


class RunQueueWait:
    """The share of this process's threads' time spent runnable but waiting for a CPU, between
    calls (Linux schedstat's run delay; 0 where it cannot be read), less what its own side work
    ran meanwhile (``counters``: cumulative nanoseconds waited and run by side work)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        counters: Callable[[], tuple[int, int]] | None = None,
    ):
        self._clock = clock
        self._counters = counters or schedstat_ns
        self._last = (clock(), *self._counters())

    def share(self, threads: int) -> float:
        now, (waited, side_ran) = self._clock(), self._counters()
        (then, waited_before, side_before), self._last = self._last, (now, waited, side_ran)
        if now <= then or waited < waited_before or side_ran < side_before:
            return 0.0  # a thread that ended took its count along: look again
        # our side work (an adapter loading) takes its CPU from our compute threads, not a
        # neighbour: the compute threads' wait it caused is no reason to give up a core
        net = max(0, (waited - waited_before) - (side_ran - side_before))
        return net / 1e9 / (now - then) / max(1, threads)


def schedstat_ns() -> tuple[int, int]:
    """Nanoseconds this process's compute threads have waited on a run queue, and nanoseconds its
    side-work threads have run (``/proc/self/task/*/schedstat``)."""
    waited = side_ran = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0, 0
    side = {str(tid) for tid in side_work_threads()}
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                ran, wait = (int(v) for v in f.read().split()[:2])
        except (OSError, ValueError):
            continue  # a thread that just ended
        if task in side:
            side_ran += ran
        else:
            waited += wait
    return waited, side_ran


@dataclass
class Timed:
    """The latest steps of one kind at the kept count, all of about ``size``."""

    size: int = 0
    times: list[float] = field(default_factory=list)


class ThreadTuner:
    """Tries one thread fewer when the CPUs are contended, one more every :data:`PROBE_EVERY_S`
    after giving some up, and keeps the faster; ``set_threads`` changes the count for the steps
    that follow; ``contention(threads)`` is the waiting share since its last call."""

    def __init__(
        self,
        most: int,
        set_threads: Callable[[int], None],
        contention: Callable[[int], float],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.most = most
        self.threads = most
        self._set = set_threads
        self._contention = contention
        self._clock = clock
        self._next_look = clock()
        self._next_up = clock() + PROBE_EVERY_S
        self._next_down = clock()  # after fewer threads were tried and were not faster: not again soon
        self._timed = {kind: Timed() for kind in STEPS}
        self._trial: tuple[str, int] | None = None  # the kind of step and the count under trial
        self._trial_times: list[float] = []

    def ran(self, kind: str, size: int, seconds: float) -> None:
        """A step ran: ``kind`` prefill (``size``: prompt tokens) or decode (sequences)."""
        if self.most <= 1:
            return
        timed = self._timed[kind]
        if abs(size - timed.size) > SAME_SIZE * timed.size:  # not comparable with what came before
            timed.size, timed.times = size, []
            if self._trial is not None and self._trial[0] == kind:
                self._end_trial(kept=self.threads)
        if self._trial is None:
            timed.times = [*timed.times, seconds][-STEPS[kind] :]
            if len(timed.times) == STEPS[kind]:
                self._maybe_start(kind)
        elif self._trial[0] == kind:
            self._trial_times.append(seconds)
            if len(self._trial_times) == STEPS[kind]:
                self._decide()

    def _maybe_start(self, kind: str) -> None:
        now = self._clock()
        if now < self._next_look:
            return
        self._next_look = now + LOOK_EVERY_S
        waiting = self._contention(self.threads)
        log.debug(
            "%s step of %d: threads %d waited %.0f%% of their time for a CPU",
            kind,
            self._timed[kind].size,
            self.threads,
            100 * waiting,
        )
        if self.threads > 1 and waiting >= CONTENDED and now >= self._next_down:
            self._start(kind, self.threads - 1)
        elif self.threads < self.most and now >= self._next_up:
            self._next_up = now + PROBE_EVERY_S
            self._start(kind, self.threads + 1)

    def _start(self, kind: str, threads: int) -> None:
        self._trial, self._trial_times = (kind, threads), []
        self._set(threads)

    def _decide(self) -> None:
        assert self._trial is not None
        kind, trial = self._trial
        timed = self._timed[kind]
        before, after = statistics.median(timed.times), statistics.median(self._trial_times)
        if before / after < MIN_GAIN:
            if trial < self.threads:  # contended, but not by what fewer threads would help
                self._next_down = self._clock() + RETRY_FEWER_S
            self._end_trial(kept=self.threads)
            timed.times = []
            return
        why = "; other work takes these CPUs" if trial < self.threads else ""
        log.info(
            "threads: %d -> %d (%s steps of %d: %.1f -> %.1f ms%s)",
            *(self.threads, trial, kind, timed.size, before * 1000, after * 1000, why),
        )
        timed.times = self._trial_times  # the steps at the new count are its baseline
        self._end_trial(kept=trial)

    def _end_trial(self, kept: int) -> None:
        assert self._trial is not None
        if kept != self._trial[1]:
            self._set(kept)
        self.threads, self._trial, self._trial_times = kept, None, []
