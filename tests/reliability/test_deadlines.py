"""Deadlines: a request whose deadline passed while it was queued is never started, one whose
deadline passes while it runs is stopped, and the server's queue timeout ends one that waited too
long; each ends with ``deadline_exceeded``. Real Redis, real tiny model."""

import time

import pytest
from conftest import reply_events
from reliability_helpers import LONG

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import ErrorCode


def test_deadline_passed_while_queued_is_not_started(run_worker, redis_url, prefix, model_path):
    with run_worker(LONG) as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        handle = client.submit("late", max_new_tokens=5, deadline_ms=int(time.time() * 1000) - 1)
        with pytest.raises(RequestFailed) as info:
            handle.result(timeout=10)
        assert running.prefill_sizes == []
    assert info.value.code == ErrorCode.DEADLINE_EXCEEDED


def test_deadline_passing_while_running_stops_it(run_worker, redis_url, prefix, r, model_path):
    with run_worker(LONG):
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        handle = client.submit(
            "slow", max_new_tokens=3000, ignore_eos=True, deadline_ms=int(time.time() * 1000) + 500
        )
        with pytest.raises(RequestFailed) as info:
            handle.result(timeout=30)
    assert info.value.code == ErrorCode.DEADLINE_EXCEEDED
    tokens = [e for e in reply_events(r, prefix, handle.id) if e.type == "token"]
    assert 0 < len(tokens) < 3000


def test_server_queue_timeout(run_worker, redis_url, prefix, model_path):
    static = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=4, max_seq_len=256, buckets=(16,), mode="static"
    )
    with run_worker(static, queue_timeout_s=0.3):
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16])
        handle = client.submit("lonely", max_new_tokens=5)  # a static batch of 4 never fills
        with pytest.raises(RequestFailed) as info:
            handle.result(timeout=10)
    assert info.value.code == ErrorCode.DEADLINE_EXCEEDED
