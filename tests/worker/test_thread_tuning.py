"""The worker's compute threads, re-measured on its own steps: nothing is tried while the CPUs
are not contended; when they are, one thread fewer is tried and kept only if clearly faster;
with threads given up, one more is tried now and then and kept once the neighbour has gone;
steps of another size are never compared. A fake clock and a fake host; no torch. Then the run
queue wait itself, read from this process's real threads."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tokenfleet.worker.tuning.threads import PROBE_EVERY_S, RETRY_FEWER_S, STEPS, RunQueueWait, ThreadTuner


class Host:
    """Step times by thread count, whether another process takes a core, the counts set."""

    def __init__(self, seconds_at: dict[int, float], neighbour: bool):
        self.seconds_at, self.neighbour = seconds_at, neighbour
        self.now, self.threads, self.sets = 0.0, max(seconds_at), []

    def set(self, threads: int) -> None:
        self.threads = threads
        self.sets.append(threads)

    def waiting(self, threads: int) -> float:
        # our threads wait for a CPU only while the neighbour's core is one of theirs
        return 0.35 if self.neighbour and threads > 1 else 0.01

    def tuner(self) -> ThreadTuner:
        return ThreadTuner(self.threads, self.set, self.waiting, clock=lambda: self.now)

    def run(self, tuner: ThreadTuner, steps: int, kind: str = "decode", size: int = 32) -> None:
        for _ in range(steps):
            seconds = self.seconds_at[self.threads]
            self.now += seconds
            tuner.ran(kind, size, seconds)


def test_alone_nothing_is_ever_tried():
    host = Host({2: 0.03, 1: 0.05}, neighbour=False)
    host.run(host.tuner(), 3000)  # 90 s of decode steps
    assert host.sets == []


def test_beside_a_neighbour_fewer_threads_are_kept_then_the_cores_taken_back():
    host = Host({2: 0.09, 1: 0.05}, neighbour=True)
    tuner = host.tuner()
    host.run(tuner, 2 * STEPS["decode"])
    assert tuner.threads == 1 == host.threads
    host.run(tuner, 400)  # tries 2 every PROBE_EVERY_S, finds them slower, stays
    assert tuner.threads == 1 and host.sets.count(2) >= 400 * 0.05 // PROBE_EVERY_S
    host.neighbour, host.seconds_at = False, {2: 0.03, 1: 0.05}  # the neighbour leaves
    host.run(tuner, int(PROBE_EVERY_S / 0.05) + 2 * STEPS["decode"])
    assert tuner.threads == 2 == host.threads


def test_a_prefill_is_compared_with_the_last_prefill_of_as_many_tokens():
    host = Host({2: 0.9, 1: 0.5}, neighbour=True)
    tuner = host.tuner()
    host.run(tuner, 1, kind="prefill", size=1024)
    assert host.threads == 1  # the next prefill runs on one thread fewer
    host.run(tuner, 3, kind="decode")  # decode steps between: not part of the trial
    host.run(tuner, 1, kind="prefill", size=1000)
    assert tuner.threads == 1


def test_contention_fewer_threads_do_not_help_is_not_tried_again_soon():
    host = Host({2: 0.03, 1: 0.05}, neighbour=True)  # waits, yet two threads stay faster
    tuner = host.tuner()
    host.run(tuner, 2 * STEPS["decode"])
    assert host.sets == [1, 2]
    host.run(tuner, int(RETRY_FEWER_S / 0.03) - 10)
    assert host.sets == [1, 2]
    host.run(tuner, 20)
    assert host.sets == [1, 2, 1, 2]  # tried again later: contention changes


def test_a_step_of_another_size_ends_a_trial_undecided():
    host = Host({2: 0.09, 1: 0.05}, neighbour=True)
    tuner = host.tuner()
    host.run(tuner, STEPS["decode"] + 1, size=32)
    assert host.threads == 1 and tuner.threads == 2  # under trial
    host.run(tuner, 1, size=8)  # the batch emptied: its step says nothing of the count
    assert host.threads == 2 == tuner.threads


def test_one_cpu_is_never_tuned():
    host = Host({1: 0.05}, neighbour=True)
    host.run(host.tuner(), 1000)
    assert host.sets == []


def test_the_run_queue_wait_of_this_process_rises_beside_a_busy_process():
    """Matrix products on every core this process may use, beside a process spinning on each of
    those cores, spend a large share of their time waiting for a CPU, and the reader sees it.
    (Alone they wait under 1% here, but CI runs tests side by side: nothing is "alone" there.)"""
    import os

    import torch

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    a = torch.randn(384, 384)
    wait = RunQueueWait()

    def multiply(seconds: float) -> float:
        wait.share(cores)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(10):
                a @ a
            time.sleep(0.001)  # a step's host work between the parallel regions
        return wait.share(cores)

    neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.2)
        contended = multiply(1.5)
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()
    assert contended > 0.2, contended


def test_side_work_runs_below_compute_and_is_not_read_as_a_neighbour():
    """An adapter's loading thread marks itself side work: nice 10, and the CPU time it runs is
    counted apart from the compute threads' waits (the tuner takes it off them: waits behind our
    own side work are no neighbour's load)."""
    import hashlib
    import os
    import threading

    from tokenfleet.config.cpus import become_side_work, side_work_threads
    from tokenfleet.worker.tuning.threads import schedstat_ns

    seen: dict[str, float] = {}

    def side() -> None:
        become_side_work()
        tid = threading.get_native_id()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["listed"] = tid in side_work_threads()
        data = bytes(1 << 20)
        before, cpu_before = schedstat_ns()[1], time.thread_time()
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            hashlib.sha256(data).digest()
        seen["cpu"] = time.thread_time() - cpu_before
        seen["counted"] = (schedstat_ns()[1] - before) / 1e9

    worker = threading.Thread(target=side)
    worker.start()
    worker.join()
    assert seen["nice"] == 10 and seen["listed"]
    assert seen["cpu"] > 0 and abs(seen["counted"] - seen["cpu"]) <= 0.2 * seen["cpu"] + 0.02, seen


def test_waits_our_side_work_caused_are_not_a_neighbours_load():
    """Over one second the compute threads waited 0.5 s while side work ran 0.4 s: 0.1 s is
    left to a neighbour; side work that ran longer than the waits leaves none."""
    clock = iter([0.0, 1.0, 2.0]).__next__
    counters = iter([(0, 0), (500_000_000, 400_000_000), (900_000_000, 1_000_000_000)]).__next__
    wait = RunQueueWait(clock, counters)
    assert wait.share(1) == pytest.approx(0.1)
    assert wait.share(2) == 0.0
