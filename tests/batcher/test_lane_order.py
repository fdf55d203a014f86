"""Priority lanes in the batcher, on a fake clock: the interactive lane goes before older batch
work and lanes never share a batch; batch-lane work waiting past ``promote_after_s`` ranks with
interactive, so a steady interactive stream never starves it."""

import pytest

from tokenfleet.batcher import Batcher, PendingRequest
from tokenfleet.config import DynamicBatchingConfig

INTERACTIVE, BATCH = 0, 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def batcher(mix_buckets=False, mode="continuous", promote_after_s=30.0, max_batch_size=4):
    clock = FakeClock()
    cfg = DynamicBatchingConfig(
        max_wait_ms=0,
        max_batch_size=max_batch_size,
        max_seq_len=64,
        buckets=(8, 16),
        mix_buckets=mix_buckets,
        mode=mode,
        promote_after_s=promote_after_s,
    )
    return Batcher(cfg, clock), clock


def add(b, clock, key, lane, length=4):
    b.add(PendingRequest(key, length, 4, clock(), lane=lane))


@pytest.mark.parametrize("mix_buckets", [False, True])
def test_interactive_goes_before_older_batch_work_and_lanes_never_mix(mix_buckets):
    b, clock = batcher(mix_buckets)
    for i in range(3):
        add(b, clock, f"b{i}", BATCH)
    clock.now += 1
    add(b, clock, "i0", INTERACTIVE, length=12)  # another bucket, and younger
    assert b.waiting_in(INTERACTIVE) == 1 and b.waiting_in(BATCH) == 3
    assert b.best_rank() == INTERACTIVE
    first = b.next_batch()
    assert [it.key for it in first.items] == ["i0"]
    second = b.next_batch()
    assert [it.key for it in second.items] == ["b0", "b1", "b2"]
    assert b.best_rank() is None


def test_batch_lane_waiting_past_promote_after_s_ranks_with_interactive():
    b, clock = batcher(promote_after_s=5)
    add(b, clock, "old-batch", BATCH)
    clock.now += 4.9
    add(b, clock, "i0", INTERACTIVE)
    assert b.take(1).items[0].key == "i0"  # not yet promoted: interactive first
    add(b, clock, "i1", INTERACTIVE)
    clock.now += 0.2  # the batch request has now waited 5.1 s: promoted, and it is the oldest
    assert b.best_rank() == INTERACTIVE
    assert b.take(1).items[0].key == "old-batch"
    assert b.take(1).items[0].key == "i1"


def test_a_steady_interactive_stream_still_lets_the_batch_lane_through():
    b, clock = batcher(promote_after_s=2, max_batch_size=1)
    add(b, clock, "batch", BATCH)
    served = []
    for n in range(100):  # one interactive arrival per 100 ms, each served at once
        add(b, clock, f"i{n}", INTERACTIVE)
        served.append(b.take(1).items[0].key)
        clock.now += 0.1
        if "batch" in served:
            break
    assert "batch" in served and len(served) <= 22  # within promote_after_s of arriving
