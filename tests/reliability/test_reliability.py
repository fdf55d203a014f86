"""Nothing lost: crash recovery with resume, cancellation, deadlines, poison entries.

Real Redis, real tiny model. A "ghost" consumer stands for a worker that died holding entries."""

import signal
import subprocess
import time

import pytest
from conftest import worker_process

from tokenfleet import protocol
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, ErrorCode, Keys, TokenEvent
from tokenfleet.protocol.affinity import shard_of

LONG = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=8, max_seq_len=4096, buckets=(16, 64))


def events_of(r, prefix, request_id):
    return [protocol.decode_event(f) for _, f in r.xrange(Keys(prefix).reply_stream(request_id))]


def assert_clean_reply(events, expected_ids):
    tokens = [e for e in events if e.type == "token"]
    assert [e.index for e in tokens] == list(range(len(tokens))), "gap or duplicate"
    assert [t for e in tokens for t in e.ids] == expected_ids
    assert [e.type for e in events if e.type != "token"] == ["done"]


def ghost_takes(r, stream, count=100):
    """A consumer that reads entries and dies without acknowledging them."""
    return r.xreadgroup(GROUP, "ghost", {stream: ">"}, count=count)


def test_redelivered_request_resumes_from_streamed_tokens(
    run_worker, redis_url, prefix, r, model_path, reference
):
    keys = Keys(prefix)
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    prompt = "resume me"
    expected = reference.greedy(reference.ids(prompt), 20, ignore_eos=True)
    handle = client.submit(prompt, max_new_tokens=20, ignore_eos=True)
    stream = handle.stream_key  # its affinity shard of bucket 16
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    assert ghost_takes(r, stream)
    # the dead worker had streamed 7 tokens before it died
    for i, tok in enumerate(expected[:7]):
        ev = TokenEvent(i, [tok], "")
        r.xadd(keys.reply_stream(handle.id), protocol.encode_event(ev), id=ev.stream_id)
    with run_worker(LONG, claim_idle_ms=200) as running:
        res = handle.result(timeout=60)
        assert running.worker.reclaimed == 1
    assert res.token_ids == expected
    assert_clean_reply(events_of(r, prefix, handle.id), expected)
    assert r.xpending(stream, GROUP)["pending"] == 0


@pytest.mark.parametrize("found", ["claimed from a dead consumer", "in its own pending list at start"])
def test_an_entry_past_max_attempts_is_dead_lettered_without_being_run(
    run_worker, redis_url, prefix, r, model_path, found
):
    """A poison entry is recognised by its delivery count alone (it is never decoded or run),
    however the worker comes by it: claimed after another consumer died holding it, or re-read
    from its own pending list after a restart under the same name. The worker goes on serving."""
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    handle = client.submit("poison", max_new_tokens=4)
    stream = handle.stream_key
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    if found == "claimed from a dead consumer":
        ((_, [(entry_id, _)]),) = ghost_takes(r, stream)
        r.xclaim(stream, GROUP, "ghost", 0, [entry_id], retrycount=5)  # already delivered 5 times
        worker = run_worker(LONG, claim_idle_ms=200, max_attempts=3)
    else:
        for attempt in range(2):  # two workers named "w-fixed" took it and died
            r.xreadgroup(GROUP, "w-fixed", {stream: "0" if attempt else ">"}, count=10)
        worker = run_worker(LONG, name="w-fixed", max_attempts=1)
    with worker:
        with pytest.raises(RequestFailed) as info:
            handle.result(timeout=30)
        assert len(client.submit("after", max_new_tokens=2).result(timeout=60).token_ids) == 2
        worker.assert_healthy()
    assert info.value.code == ErrorCode.TOO_MANY_ATTEMPTS
    assert [f[b"code"] for _, f in r.xrange(Keys(prefix).dead_letter)] == [b"too_many_attempts"]
    assert r.xpending(stream, GROUP)["pending"] == 0


def test_kill_9_mid_stream_second_worker_finishes_everything(
    run_worker, redis_url, prefix, r, tiny_model, model_path, reference
):
    prompts = ["one", "two two", "three three three", "four", "five five", "six"]
    new = 160
    keys = Keys(prefix)
    first = worker_process(
        tiny_model,
        redis_url,
        prefix,
        "--buckets",
        "16,64",
        "--max-wait-ms",
        "50",
        "--claim-idle-ms",
        "1000",
        "--max-seq-len",
        "4096",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        handles = [client.submit(p, max_new_tokens=new, ignore_eos=True) for p in prompts]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(r.xlen(keys.reply_stream(h.id)) >= 3 for h in handles):
                break
            time.sleep(0.01)
        else:
            pytest.fail("the first worker never streamed")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        partial = [r.xlen(keys.reply_stream(h.id)) for h in handles]
        assert all(n < new for n in partial), f"the first worker finished before the kill: {partial}"
        with run_worker(LONG, claim_idle_ms=1000) as second:
            results = [h.result(timeout=180) for h in handles]
            assert second.worker.reclaimed == len(prompts)
    finally:
        if first.poll() is None:
            first.kill()
    for p, h, res in zip(prompts, handles, results):
        expected = reference.greedy(reference.ids(p), new, ignore_eos=True)
        assert res.token_ids == expected
        assert_clean_reply(events_of(r, prefix, h.id), expected)


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
    tokens = [e for e in events_of(r, prefix, handle.id) if e.type == "token"]
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


def test_restart_under_the_same_name_resumes_its_own_pending_at_once(
    run_worker, redis_url, prefix, r, model_path, reference
):
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    handle = client.submit("mine", max_new_tokens=6)
    stream = handle.stream_key
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    r.xreadgroup(GROUP, "worker-7", {stream: ">"})  # a worker named worker-7 took it, then restarted
    # claim_idle_ms is long: only reading its own pending list can explain a prompt finish
    with run_worker(LONG, name="worker-7", claim_idle_ms=600_000):
        res = handle.result(timeout=30)
    assert res.token_ids == reference.greedy(reference.ids("mine"), 6)
