"""The TTFT-target wait controller, driven by a fake clock against a simulated worker: a request's
TTFT is what the load costs (``base``) plus its share of the wait in force when it arrived."""

import random

import pytest

from tokenfleet.batcher.ttft_target import UPDATE_S, WaitController, p90

TICK_S = 0.01


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(controller, clock, seconds, rate, base_s, rng, log):
    """Advance ``seconds`` of Poisson arrivals at ``rate``/s; each one's TTFT is ``base_s`` plus
    part of the wait (the first of a batch waits all of it). Appends (time, wait, ttft) to log."""
    end = clock.now + seconds
    while clock.now < end:
        wait = controller.current()
        controller.decode_ran(0.008)
        if rng.random() < rate * TICK_S:
            controller.arrived()
            ttft = base_s + wait * rng.uniform(0.5, 1.0)
            controller.prefill_ran(60, 1, 0.004)
            controller.first_token(ttft)
            log.append((clock.now, wait, ttft))
        clock.now += TICK_S


def window(log, start, end):
    return [entry for entry in log if start <= entry[0] < end]


def test_a_calm_lane_waits_most_of_the_target_for_bigger_batches_and_stays_under_it():
    clock, rng, log = Clock(), random.Random(1), []
    ctl = WaitController(target_s=0.2, max_wait_s=1.0, clock=clock)
    simulate(ctl, clock, 20, rate=4, base_s=0.02, rng=rng, log=log)
    late = window(log, 10, 20)
    assert 0.08 <= ctl.wait_s <= 0.18  # most of the target, never all of it
    assert p90([ttft for _, _, ttft in late]) <= 0.2


def test_a_burst_cuts_the_wait_within_seconds_and_keeps_the_p90_under_target():
    clock, rng, log = Clock(), random.Random(2), []
    ctl = WaitController(target_s=0.2, max_wait_s=1.0, clock=clock)
    simulate(ctl, clock, 15, rate=4, base_s=0.02, rng=rng, log=log)
    calm_wait = ctl.wait_s
    simulate(ctl, clock, 15, rate=40, base_s=0.15, rng=rng, log=log)  # busy: the load costs 150 ms
    after_2s = [wait for t, wait, _ in window(log, 17, 30)]
    assert max(after_2s) <= 0.2 - 0.15 + 0.01 < calm_wait
    assert p90([ttft for _, _, ttft in window(log, 18, 30)]) <= 0.2
    simulate(ctl, clock, 20, rate=4, base_s=0.02, rng=rng, log=log)  # calm again: the wait comes back
    assert ctl.wait_s >= 0.6 * calm_wait
    assert p90([ttft for _, _, ttft in window(log, 40, 50)]) <= 0.2


def test_the_wait_settles_instead_of_swinging():
    clock, rng, log = Clock(), random.Random(3), []
    ctl = WaitController(target_s=0.3, max_wait_s=1.0, clock=clock)
    simulate(ctl, clock, 15, rate=20, base_s=0.1, rng=rng, log=log)
    waits = []
    for _ in range(int(20 / UPDATE_S)):  # 20 s of steady load, one reading per update
        simulate(ctl, clock, UPDATE_S, rate=20, base_s=0.1, rng=rng, log=log)
        waits.append(ctl.wait_s)
    assert max(waits) - min(waits) <= 0.25 * 0.3  # within a quarter of the target
    assert max(abs(b - a) for a, b in zip(waits, waits[1:])) <= 0.1 * 0.3, waits  # no jumps


def test_an_unreachable_target_waits_no_longer_than_one_decode_step():
    clock, rng, log = Clock(), random.Random(4), []
    ctl = WaitController(target_s=0.1, max_wait_s=0.5, clock=clock)
    simulate(ctl, clock, 10, rate=30, base_s=0.3, rng=rng, log=log)
    assert ctl.wait_s == pytest.approx(0.008)  # the simulated step


def test_the_wait_never_leaves_zero_to_max_wait():
    clock, rng, log = Clock(), random.Random(5), []
    ctl = WaitController(target_s=5.0, max_wait_s=0.05, clock=clock)
    simulate(ctl, clock, 10, rate=2, base_s=0.0, rng=rng, log=log)
    assert all(0.0 <= wait <= 0.05 for _, wait, _ in log) and ctl.wait_s == 0.05
    assert "wait 50.0 ms for a 5000 ms TTFT target" in ctl.describe()


def test_a_target_must_be_positive():
    with pytest.raises(ValueError, match="TTFT target"):
        WaitController(target_s=0, max_wait_s=0.05)
