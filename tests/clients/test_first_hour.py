"""The contract as a newcomer meets it: a reply whenever an id can be read, queue times from
when Redis took the request, a bucket list of live workers only. Real worker, real Redis."""

import time

import msgpack
import pytest

from tokenfleet import protocol
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import Keys

pytestmark = pytest.mark.integration

BATCHING = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=8, max_seq_len=256, buckets=(16, 64))


def test_a_msgpack_request_with_a_prompt_not_utf8_is_answered(run_worker, redis_url, prefix, r, model_path):
    body = (
        b"\x82" + msgpack.packb("id") + msgpack.packb("not-utf8") + msgpack.packb("prompt") + b"\xa2\xff\xfe"
    )
    with run_worker(BATCHING):
        r.xadd(Keys(prefix).request_stream(16), {"m": body})
        with pytest.raises(RequestFailed) as info:
            Client(redis_url, prefix=prefix).result("not-utf8", timeout=30)
    assert info.value.code == protocol.ErrorCode.UNDECODABLE
    assert [f[b"code"] for _, f in r.xrange(Keys(prefix).dead_letter)] == [b"undecodable"]


def test_an_auto_requests_queue_time_counts_from_when_redis_took_it(run_worker, redis_url, prefix, r):
    client = Client(redis_url, prefix=prefix)  # no tokenizer here: the auto stream
    handle = client.submit("waited for a worker", max_new_tokens=2)
    time.sleep(1.5)  # no worker yet
    with run_worker(BATCHING):
        res = handle.result(timeout=60)
    assert res.timings["queue_ms"] >= 1400, res.timings


def test_the_bucket_list_holds_live_workers_buckets_only(run_worker, redis_url, prefix, r):
    keys = Keys(prefix)
    r.sadd(keys.buckets, 999)  # announced by a worker that stopped long ago
    stale = {"buckets": [999], "seen": time.time() - 3600}
    r.hset(keys.workers, "gone-worker", protocol.pack(stale))
    with run_worker(BATCHING):
        deadline = time.monotonic() + 30
        while b"999" in r.smembers(keys.buckets):
            assert time.monotonic() < deadline, "the stale bucket stayed"
            time.sleep(0.1)
        assert {int(b) for b in r.smembers(keys.buckets)} == {16, 64}


def test_the_heartbeat_carries_the_engine_and_kv_use(run_worker, redis_url, prefix, r):
    from tokenfleet.cli.fleet import format_status
    from tokenfleet.transport.status import fleet_status

    with run_worker(BATCHING):
        (beat,) = fleet_status(r, Keys(prefix))["workers"]
        table = format_status(fleet_status(r, Keys(prefix)))
    assert beat["engine"] == "native" and beat["kv_blocks_total"] > 0
    assert f"0/{beat['kv_blocks_total']}" in table and " 0/0" not in table
