"""The turn policy on a fake clock: when a turn talks to Redis, and whether it overlaps the step."""

import logging

from tokenfleet.worker.policy import OVERLAP_MIN_SHARE, Plan, TurnPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(overlap_io="auto", shared=True, interval_s=0.005):
    clock = Clock()
    return TurnPolicy(overlap_io, shared, interval_s, clock=clock), clock


def test_idle_stopping_and_cluster_turns_talk_to_redis_on_their_own():
    p, _ = policy()
    assert p.plan(busy=False, stopping=False, replies_waiting=False) is Plan.SEPARATE
    assert p.plan(busy=True, stopping=True, replies_waiting=True) is Plan.DRAIN
    cluster, _ = policy(shared=False)
    assert cluster.plan(busy=True, stopping=False, replies_waiting=True) is Plan.SEPARATE
    assert not cluster.rides_on_steps(busy=True, stopping=False)
    assert p.rides_on_steps(busy=True, stopping=False) and not p.rides_on_steps(busy=False, stopping=False)


def test_a_busy_turn_with_nothing_to_send_skips_until_the_interval_passes():
    p, clock = policy(overlap_io="off", interval_s=0.05)
    assert p.plan(busy=True, stopping=False, replies_waiting=False) is Plan.INLINE  # the first one goes
    clock.now += 0.01
    assert p.plan(busy=True, stopping=False, replies_waiting=False) is Plan.SKIP
    assert p.plan(busy=True, stopping=False, replies_waiting=True) is Plan.INLINE  # replies never wait
    clock.now += 0.049
    assert p.plan(busy=True, stopping=False, replies_waiting=False) is Plan.SKIP
    clock.now += 0.002
    assert p.plan(busy=True, stopping=False, replies_waiting=False) is Plan.INLINE


def test_on_and_off_decide_without_measuring():
    on, _ = policy("on")
    off, _ = policy("off")
    assert on.plan(busy=True, stopping=False, replies_waiting=True) is Plan.OVERLAP
    assert off.plan(busy=True, stopping=False, replies_waiting=True) is Plan.INLINE


def test_auto_overlaps_a_round_trip_that_is_a_sizable_share_of_a_step(caplog):
    p, _ = policy("auto")
    assert p.plan(busy=True, stopping=False, replies_waiting=True) is Plan.INLINE  # nothing measured yet
    p.step_done(0.100)
    p.round_trip_done(0.100 * OVERLAP_MIN_SHARE * 0.5)
    assert p.plan(busy=True, stopping=False, replies_waiting=True) is Plan.INLINE
    with caplog.at_level(logging.INFO, logger="tokenfleet.worker.policy"):
        for _ in range(20):  # the averages move toward a slow round trip, then the choice flips once
            p.round_trip_done(0.100 * OVERLAP_MIN_SHARE * 2)
            p.plan(busy=True, stopping=False, replies_waiting=True)
    assert p.plan(busy=True, stopping=False, replies_waiting=True) is Plan.OVERLAP
    assert caplog.text.count("overlapping it with the next step") == 1
