"""Dispatch rules of the batcher, driven by a fake clock, and the checks of the batching config
that sets them."""

import pytest

from tokenfleet.batcher import Batcher, PendingRequest
from tokenfleet.config import DynamicBatchingConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1000


def make(
    mode="dynamic", mix_buckets=False, max_wait_ms=50, max_batch_size=4, buckets=(8, 16, 32), max_seq_len=64
):
    clock = FakeClock()
    cfg = DynamicBatchingConfig(
        max_wait_ms=max_wait_ms,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        buckets=buckets,
        mix_buckets=mix_buckets,
        mode=mode,
    )
    return Batcher(cfg, clock), clock


def req(batcher, clock, key, length, new=4):
    batcher.add(PendingRequest(key, length, new, clock()))
    return key


def keys(batch):
    return [item.key for item in batch.items]


def test_dispatches_at_max_batch_size_before_max_wait():
    b, clock = make(max_batch_size=3)
    for k in "abc":
        req(b, clock, k, 5)
        clock.advance(1)
    batch = b.next_batch()
    assert keys(batch) == ["a", "b", "c"]
    assert len(b) == 0


def test_dispatches_at_max_wait_with_fewer():
    b, clock = make(max_batch_size=4, max_wait_ms=50)
    req(b, clock, "a", 5)
    req(b, clock, "b", 6)
    clock.advance(49)
    assert b.next_batch() is None
    assert b.ready_at() == pytest.approx(100.05)
    clock.advance(1)
    assert keys(b.next_batch()) == ["a", "b"]


def test_wait_is_measured_from_oldest_pending_request():
    b, clock = make(max_wait_ms=50)
    req(b, clock, "old", 5)
    clock.advance(40)
    req(b, clock, "new", 5)
    clock.advance(10)  # old has waited 50 ms, new only 10
    assert keys(b.next_batch()) == ["old", "new"]


def test_static_waits_for_a_full_batch():
    b, clock = make(mode="static", max_batch_size=2)
    req(b, clock, "a", 5)
    clock.advance(10_000)
    assert b.next_batch() is None and b.ready_at() is None
    req(b, clock, "b", 5)
    assert keys(b.next_batch()) == ["a", "b"]


def test_bucket_padding_never_mixes_buckets():
    b, clock = make(max_batch_size=4)
    req(b, clock, "short1", 4)
    req(b, clock, "long1", 20)
    req(b, clock, "short2", 8)
    req(b, clock, "long2", 30)
    clock.advance(50)
    first, second = b.next_batch(), b.next_batch()
    assert keys(first) == ["short1", "short2"] and first.buckets == (8,)
    assert keys(second) == ["long1", "long2"] and second.buckets == (32,)


def test_bucket_with_oldest_request_goes_first():
    b, clock = make(max_batch_size=2)
    req(b, clock, "quiet", 20)
    clock.advance(5)
    req(b, clock, "busy1", 4)
    req(b, clock, "busy2", 4)
    # both buckets are due (busy is full, quiet has waited); quiet has waited longer
    clock.advance(50)
    assert keys(b.next_batch()) == ["quiet"]
    assert keys(b.next_batch()) == ["busy1", "busy2"]


def test_mix_buckets_forms_one_batch_from_every_bucket_oldest_first():
    b, clock = make(mix_buckets=True, max_batch_size=3)
    req(b, clock, "a", 4)
    req(b, clock, "b", 30)
    req(b, clock, "c", 10)
    req(b, clock, "d", 5)
    batch = b.next_batch()
    assert keys(batch) == ["a", "b", "c"]
    assert batch.buckets == (8, 16, 32)
    assert batch.prompt_tokens == 44


def test_the_old_padding_spelling_still_works_for_one_release():
    with pytest.warns(FutureWarning, match="--mix-buckets"):
        assert DynamicBatchingConfig(padding="max").mix_buckets
    with pytest.warns(FutureWarning, match="--no-mix-buckets"):
        assert not DynamicBatchingConfig(padding="bucket").mix_buckets
    with pytest.raises(ValueError, match="contradicts"):
        DynamicBatchingConfig(padding="bucket", mix_buckets=True)


def test_a_prompt_no_bucket_holds_is_a_callers_bug():
    b, clock = make(buckets=(8, 16, 32), max_seq_len=40)
    with pytest.raises(ValueError, match="no bucket"):
        b.add(PendingRequest("x", 33, 1, clock()))
    assert len(b) == 0


def test_take_ignores_the_wait_and_honours_limit():
    b, clock = make(max_batch_size=8)
    for k in "abc":
        req(b, clock, k, 5)
    assert b.next_batch() is None
    assert keys(b.take(2)) == ["a", "b"]
    assert keys(b.take(5)) == ["c"]
    assert b.take(1) is None


def test_requeue_puts_items_back_in_front():
    b, clock = make(max_batch_size=2)
    for k in "abc":
        req(b, clock, k, 5)
    batch = b.next_batch()
    b.requeue(list(batch.items))
    assert keys(b.take(3)) == ["a", "b"]  # still capped by max_batch_size
    assert keys(b.take(3)) == ["c"]


def test_remove_drops_matching_requests():
    b, clock = make()
    for k in "abc":
        req(b, clock, k, 5)
    removed = b.remove(lambda item: item.key == "b")
    assert [item.key for item in removed] == ["b"]
    assert [item.key for item in b.pending()] == ["a", "c"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_wait_ms=-1), "max_wait_ms"),
        (dict(max_batch_size=0), "max_batch_size"),
        (dict(buckets=()), "buckets"),
        (dict(buckets=(16, 8)), "buckets"),
        (dict(buckets=(8, 128), max_seq_len=64), "buckets"),
        (dict(mix_buckets="yes"), "mix_buckets"),
        (dict(mode="eager"), "mode"),
        (dict(max_prefill_tokens=0), "max_prefill_tokens"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DynamicBatchingConfig(**kwargs)
