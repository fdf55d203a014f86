"""Cancellation: a queued request never starts, a running one stops within a step and frees its
KV blocks, and the raw-Redis cancel that docs/PROTOCOL.md shows works as written. Real Redis,
real tiny model."""

import time

from reliability_helpers import LONG

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, Keys


def test_cancel_queued_request_never_starts(run_worker, redis_url, prefix, r, model_path):
    waiting = DynamicBatchingConfig(max_wait_ms=60_000, max_batch_size=8, max_seq_len=256, buckets=(16,))
    with run_worker(waiting) as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16])
        handle = client.submit("never", max_new_tokens=5)
        time.sleep(0.3)  # read and waiting for its batch
        handle.cancel()
        res = handle.result(timeout=10)
        assert running.prefill_sizes == []
    assert res.finish_reason == "cancelled" and res.token_ids == []
    assert r.xpending(handle.stream_key, GROUP)["pending"] == 0


def test_cancel_running_request_stops_within_a_step_and_frees_blocks(
    run_worker, redis_url, prefix, r, model_path
):
    keys = Keys(prefix)
    with run_worker(LONG) as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        handle = client.submit("cancel me", max_new_tokens=3000, ignore_eos=True)
        while r.xlen(keys.reply_stream(handle.id)) < 5:
            time.sleep(0.005)
        handle.cancel()
        streamed_at_cancel = r.xlen(keys.reply_stream(handle.id))
        res = handle.result(timeout=30)
        time.sleep(0.1)
        assert running.core.scheduler.allocator.num_used_blocks == 0
    assert res.finish_reason == "cancelled"
    assert len(res.token_ids) <= streamed_at_cancel + 2, "kept generating after the cancel"
    assert res.usage["completion_tokens"] == len(res.token_ids)


def test_raw_redis_cancel_as_documented(run_worker, redis_url, prefix, r, model_path):
    with run_worker(LONG):
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        handle = client.submit("cancel me raw", max_new_tokens=3000, ignore_eos=True)
        next(iter(handle.stream(timeout=30)))
        r.set(f"{prefix}:cancel:{handle.id}", 1, ex=3600)  # exactly as PROTOCOL.md says
        r.xadd("{" + prefix + "}:cancels", {"id": handle.id})
        assert handle.result(timeout=30).finish_reason == "cancelled"
