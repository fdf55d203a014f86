"""What waits in Redis stays bounded and nothing accepted is lost: a full queue refuses new
requests with ``QueueFull`` instead of trimming, and stream trims remove acknowledged entries
only. Real Redis, real tiny model."""

import time

import pytest
from reliability_helpers import LONG

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, Keys
from tokenfleet.protocol.affinity import shard_of


def test_full_queue_refuses_with_queue_full_instead_of_trimming(run_worker, redis_url, prefix, r, model_path):
    """max_queue counts what waits over the bucket's stream and all its affinity shards."""
    from tokenfleet.errors import QueueFull
    from tokenfleet.transport.status import queue_totals

    slow = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=2, max_seq_len=4096, buckets=(16,), mode="dynamic"
    )
    keys = Keys(prefix)
    streams = keys.queue_streams(16)
    with run_worker(slow, max_queue=3):
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16])
        handles = []
        with pytest.raises(QueueFull, match="max_queue 3"):
            for i in range(20):
                handles.append(client.submit(f"q{i}", max_new_tokens=3000, ignore_eos=True))
                time.sleep(0.1)
        assert len({h.stream_key for h in handles}) > 1  # spread over shards, counted together
        # the worker holds 2 running + 1 read ahead (a quarter batch, at least 1); the rest wait
        # undelivered (3 when the worker kept up with the submissions)
        assert 3 < len(handles) <= 6
        deadline = time.monotonic() + 30
        while queue_totals(r, streams, time.time())["depth"] != len(handles) - 3:
            assert time.monotonic() < deadline, queue_totals(r, streams, time.time())
            time.sleep(0.05)
        assert sum(r.xlen(s) for s in streams) == len(handles)  # nothing was trimmed away
        for h in handles:
            h.cancel()
        assert {h.result(timeout=30).finish_reason for h in handles} == {"cancelled"}


def test_streams_are_trimmed_of_acknowledged_entries_only(run_worker, redis_url, prefix, r, model_path):
    """Trims run while an entry is unacknowledged (a long request still running, with entries
    acknowledged on both sides of it): the ones before it go, it and those after it stay until it
    is done; then the stream empties."""
    key = "trim"  # one affinity key: every request on one shard stream
    stream = Keys(prefix).shard_stream(16, "interactive", shard_of({"cache_key": key}))
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    with run_worker(LONG, trim_interval_s=0.05):
        client.submit("before", max_new_tokens=2, cache_key=key).result(timeout=60)
        long = client.submit("long", max_new_tokens=3000, ignore_eos=True, cache_key=key)
        ((long_entry, _),) = r.xrevrange(stream, count=1)  # the newest entry: nothing else submits
        for h in [client.submit(f"after {i}", max_new_tokens=2, cache_key=key) for i in range(5)]:
            h.result(timeout=60)
        deadline = time.monotonic() + 30
        while [e for e, _ in r.xrange(stream)][:1] != [long_entry]:  # "before" trimmed, "long" first
            assert time.monotonic() < deadline, r.xrange(stream)
            time.sleep(0.02)
        assert r.xpending(stream, GROUP)["pending"] == 1, "the long request was not running"
        for _ in range(10):  # more trims pass with it pending: none removes it or anything after
            time.sleep(0.05)
            assert len(r.xrange(stream)) == 6 and r.xrange(stream)[0][0] == long_entry
        long.cancel()
        assert long.result(timeout=60).finish_reason == "cancelled"
        deadline = time.monotonic() + 30
        while r.xlen(stream):
            assert time.monotonic() < deadline, r.xrange(stream)
            time.sleep(0.02)
