"""Prefix affinity on real worker processes: a key's requests go to the worker that owns its
shard; a shard whose owner does not read it (busy, hung, or gone but not yet stale) is stolen
from after the steal delay; a worker killed -9 hands its shards and its requests (resumed, no
gap, no repeat) to the survivor; a producer that knows nothing of shards is still served."""

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


def start_workers(tiny_model, redis_url, prefix, logs, max_seq_len: int, *flags: str) -> list:
    """Worker processes ``wa`` and ``wb`` (bucket 16, one thread each), logging to ``logs``."""
    common = ("--buckets", "16", "--threads", "1", "--max-wait-ms", "5", "--max-seq-len", str(max_seq_len))
    return [
        worker_process(
            tiny_model,
            redis_url,
            prefix,
            *common,
            "--name",
            name,
            *flags,
            env={"OMP_NUM_THREADS": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for name, log in zip(["wa", "wb"], logs)
    ]


@pytest.mark.timeout(240)
def test_a_key_stays_on_its_owner_and_an_unread_shard_is_stolen(tiny_model, redis_url, prefix, r, tmp_path):
    names = ["wa", "wb"]
    logs = [open(tmp_path / f"{n}.log", "w+") for n in names]  # noqa: SIM115 (closed below)
    workers = start_workers(tiny_model, redis_url, prefix, logs, 256, "--steal-after-ms", str(STEAL_AFTER_MS))
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


@pytest.mark.timeout(240)
def test_a_worker_killed_mid_load_hands_its_shards_and_requests_to_the_survivor(
    tiny_model, redis_url, prefix, r, reference, tmp_path
):
    names = ["wa", "wb"]
    logs = [open(tmp_path / f"{n}.log", "w+") for n in names]  # noqa: SIM115 (closed below)
    workers = start_workers(tiny_model, redis_url, prefix, logs, 512, "--claim-idle-ms", "1000")
    keys = Keys(prefix)
    try:
        for log in logs:
            wait_for_log(log, "owning 8 of 16 shards per lane (live workers: wa, wb)")
        client = Client(redis_url, model=tiny_model, prefix=prefix)
        owners = rendezvous_owners(names, SHARDS, "16")
        doomed = [f"c{i}" for i in range(200) if owners[shard_of({"cache_key": f"c{i}"})] == "wa"][:6]
        handles = [
            client.submit(f"mid {i}", cache_key=key, max_new_tokens=200, ignore_eos=True)
            for i, key in enumerate(doomed)
        ]
        deadline = time.monotonic() + 120
        while not all(r.xlen(keys.reply_stream(h.id)) >= 3 for h in handles):
            assert time.monotonic() < deadline, "wa never streamed"
            time.sleep(0.01)
        workers[0].kill()  # -9, holding all six mid-stream
        workers[0].wait(10)
        # on wa's shards meanwhile: stolen at once, then wb's own once wa's heartbeat is stale
        after = [client.submit(f"after {i}", cache_key=k, max_new_tokens=4) for i, k in enumerate(doomed)]
        wait_for_log(logs[1], "owning 16 of 16 shards per lane (live workers: wb)", timeout=60)
        for i, h in enumerate(handles):
            res = h.result(timeout=120)
            expected = reference.greedy(reference.ids(f"mid {i}"), 200, ignore_eos=True)
            assert res.worker == "wb" and res.token_ids == expected
            events = [protocol.decode_event(f) for _, f in r.xrange(keys.reply_stream(h.id))]
            tokens = [e for e in events if e.type == "token"]
            assert [e.index for e in tokens] == list(range(len(tokens))), "gap or duplicate"
            assert [e.type for e in events if e.type != "token"] == ["done"]
        assert {h.result(timeout=60).worker for h in after} == {"wb"}
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()
                w.wait(60)
        for log in logs:
            log.close()
