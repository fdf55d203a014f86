"""Poison entries, those that keep failing: past ``max_attempts`` an entry is dead-lettered by its
delivery count alone, never decoded or run; a worker killed -9 while it holds thousands of poison
entries takes nothing else down: every entry is answered or dead-lettered, valid requests complete.

Real Redis, real tiny model. A "ghost" consumer stands for a worker that died holding entries."""

import signal
import time

import pytest
from conftest import worker_process
from reliability_helpers import LONG, deep, error_of, ghost_takes, pending

from tokenfleet import protocol
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, ErrorCode, Keys


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


@pytest.mark.timeout(180)  # a minute or more on a busy 2-core machine
def test_a_worker_killed_while_taking_poison_entries_does_not_take_the_fleet_down(
    redis_url, prefix, r, tiny_model, model_path, tmp_path
):
    """Poison entries pour in; a worker is killed -9 while it holds some; a restarted worker
    (same name: its own pending list first) and a second one (claiming) take over: every entry is
    answered or dead-lettered, and valid requests complete."""
    keys = Keys(prefix)
    stream = keys.request_stream(16)
    flags = ["--buckets", "16,64", "--max-wait-ms", "5", "--claim-idle-ms", "500", "--max-batch-size", "8"]
    log = open(tmp_path / "workers.log", "w")  # noqa: SIM115 (closed below)
    first = worker_process(tiny_model, redis_url, prefix, "--name", "w-a", *flags, stdout=log, stderr=log)
    others = []
    try:
        deadline = time.monotonic() + 120
        while not r.hlen(keys.workers):
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        pipe = r.pipeline(transaction=False)
        for i in range(3000):
            pipe.xadd(stream, {"id": f"poison-{i}", "max_new_tokens": "2", "input_ids": deep(1000 + i % 7)})
        pipe.execute()
        deadline = time.monotonic() + 60
        while not r.xpending(stream, GROUP)["pending"]:
            assert time.monotonic() < deadline, "the worker never took the poison entries"
            time.sleep(0.001)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed_at = time.time()  # the killed w-a's registry entry stays, fresh for a few seconds
        others = [
            worker_process(tiny_model, redis_url, prefix, "--name", name, *flags, stdout=log, stderr=log)
            for name in ("w-a", "w-b")
        ]
        deadline = time.monotonic() + 180  # both up: the restarted one read its own pending list first
        while {n.decode() for n in r.hkeys(keys.workers)} != {"w-a", "w-b"} or any(
            protocol.unpack(raw)["seen"] <= killed_at for raw in r.hvals(keys.workers)
        ):
            assert time.monotonic() < deadline and all(p.poll() is None for p in others)
            time.sleep(0.1)
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        handles = [client.submit(f"valid {i}", max_new_tokens=3) for i in range(8)]
        assert all(len(h.result(timeout=120).token_ids) == 3 for h in handles)
        deadline = time.monotonic() + 120
        while pending(r, prefix) or any(
            g["lag"] for g in r.xinfo_groups(stream) if g["name"] == GROUP.encode()
        ):
            assert time.monotonic() < deadline, "entries left unanswered"
            time.sleep(0.1)
        assert all(p.poll() is None for p in others), "a worker died"
        assert error_of(client, "poison-0").code in (ErrorCode.UNDECODABLE, ErrorCode.TOO_MANY_ATTEMPTS)
    finally:
        for proc in [first, *others]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        log.close()
    assert [p.returncode for p in others] == [0, 0]
