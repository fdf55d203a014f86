"""Prefix affinity on real worker processes: a key's requests go to the worker that owns its
shard; a shard whose owner does not read it (busy, hung, or gone but not yet stale) is stolen
from after the steal delay; a producer that knows nothing of shards is still served."""

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import worker_process

from tokenfleet import protocol
from tokenfleet.producer import Client
from tokenfleet.protocol import Keys
from tokenfleet.protocol.affinity import SHARDS, rendezvous_owners, shard_of

STEAL_AFTER_MS = 400


def key_owned_by(owner: str, workers: list[str], bucket: int) -> str:
    owners = rendezvous_owners(sorted(workers), SHARDS, str(bucket))
    return next(f"conv-{i}" for i in range(1000) if owners[shard_of({"cache_key": f"conv-{i}"})] == owner)


def wait_for_log(log, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log.seek(0)
        if text in log.read():
            return
        time.sleep(0.2)
    log.seek(0)
    raise AssertionError(f"no {text!r} in the worker's log:\n{log.read()[-3000:]}")


@pytest.mark.timeout(240)
def test_a_key_stays_on_its_owner_and_an_unread_shard_is_stolen(tiny_model, redis_url, prefix, r, tmp_path):
    names = ["wa", "wb"]
    logs = [open(tmp_path / f"{n}.log", "w+") for n in names]  # noqa: SIM115 (closed below)
    flags = ("--buckets", "16", "--threads", "1", "--max-wait-ms", "5", "--max-seq-len", "256")
    workers = [
        worker_process(
            tiny_model,
            redis_url,
            prefix,
            *flags,
            "--name",
            name,
            "--steal-after-ms",
            str(STEAL_AFTER_MS),
            env={"OMP_NUM_THREADS": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for name, log in zip(names, logs)
    ]
    keys = Keys(prefix)
    stop_ghost = threading.Event()
    try:
        for log in logs:  # both alive, each owning half of the 16 shards
            wait_for_log(log, "owning 8 of 16 shards per lane (live workers: wa, wb)")
        client = Client(redis_url, model=tiny_model, prefix=prefix)
        for owner in names:
            key = key_owned_by(owner, names, 16)
            served = {
                client.submit(f"turn {t}", cache_key=key, max_new_tokens=3).result(60).worker
                for t in range(6)
            }
            assert served == {owner}, key

        # a live heartbeat whose worker never reads: its shards' requests wait, then are stolen
        def ghost() -> None:
            while not stop_ghost.is_set():
                r.hset(keys.workers, "ghost", protocol.pack({"buckets": [16], "seen": time.time()}))
                stop_ghost.wait(1)

        threading.Thread(target=ghost, daemon=True).start()
        for log in logs:
            wait_for_log(log, "live workers: ghost, wa, wb")
        key = key_owned_by("ghost", ["ghost", *names], 16)
        with ThreadPoolExecutor(4) as pool:
            handles = [client.submit(f"orphan {i}", cache_key=key, max_new_tokens=3) for i in range(4)]
            results = list(pool.map(lambda h: h.result(60), handles))
        assert {res.worker for res in results} <= set(names)
        assert all(res.timings["queue_ms"] >= STEAL_AFTER_MS * 0.9 for res in results), [
            res.timings for res in results
        ]

        # a producer that knows nothing of shards: a plain XADD to the bucket's documented stream
        r.xadd(keys.request_stream(16), {"id": "plain-1", "prompt": "hi", "max_new_tokens": "2"})
        assert client.result("plain-1", timeout=60).worker in names
    finally:
        stop_ghost.set()
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(60)
        r.hdel(keys.workers, "ghost")
        for log in logs:
            log.close()
    assert [w.returncode for w in workers] == [0, 0]
