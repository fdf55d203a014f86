"""`tokenfleet status` against a running worker: what it shows matches Redis."""

import json
import os
import subprocess
import sys

from tokenfleet.protocol import GROUP, Keys
from tokenfleet.transport.status import fleet_status


def test_status_shows_live_worker_and_queues_matching_redis(run_worker, redis_url, prefix, r, model_path):
    from tokenfleet.producer import Client

    keys = Keys(prefix)
    with run_worker() as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        for i in range(3):  # one after another: the later ones find the shared start cached
            client.submit(f"a prompt start the three share, then {i}", max_new_tokens=3).result(timeout=60)
        # a bucket announced by a worker that is gone: its requests wait, undelivered
        r.sadd(keys.buckets, 128)
        r.xgroup_create(keys.request_stream(128), GROUP, id="0", mkstream=True)
        r.xgroup_create(keys.request_stream(128, "batch"), GROUP, id="0", mkstream=True)
        for i in range(4):
            r.xadd(keys.request_stream(128), {"id": f"w{i}", "prompt": "waiting"})
        for i in range(2):
            r.xadd(keys.request_stream(128, "batch"), {"id": f"b{i}", "prompt": "waiting"})
        r.xadd(keys.request_stream(16), {"m": b"\xc1"})  # junk: dead-lettered
        for _ in range(1200):  # dead-lettered and acked (a loaded host may take a while)
            if r.xlen(keys.dead_letter) and not r.xpending(keys.request_stream(16), GROUP)["pending"]:
                break
            running.thread.join(0.05)
        running.worker.upkeep.heartbeat(force=True)
        report = fleet_status(r, keys)
        out = subprocess.run(
            [sys.executable, "-m", "tokenfleet", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix},
        )
        table = subprocess.run(
            [sys.executable, "-m", "tokenfleet", "status"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix},
        )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["queues"]["128"]["depth"] == 4
    [worker] = report["workers"]
    assert worker["name"] == running.worker.name and worker["alive"] and worker["buckets"] == [16, 32, 64]
    assert worker["finished"] == 3 and worker["shards_owned"] == 48
    assert 0 < worker["prefix_cache_hits"] < worker["prefix_cache_queries"]
    hit_rate = f"{worker['prefix_cache_hits'] / worker['prefix_cache_queries']:.0%}"
    worker_row = next(line for line in table.stdout.splitlines() if line.startswith(running.worker.name[:28]))
    # the only worker: all 16 shards of 3 buckets; no adapters resident
    assert worker_row.split()[-3:] == [hit_rate, "48", "-"]
    assert report["queues"]["128"]["depth"] == 4 and report["queues"]["128"]["oldest_waiting_s"] >= 0
    assert report["queues"]["16"] == {
        "bucket": 16,
        "lane": "interactive",
        "depth": 0,
        "pending": 0,
        "oldest_waiting_s": None,
    }
    assert report["queues"]["128:batch"]["depth"] == 2 and report["queues"]["128:batch"]["lane"] == "batch"
    assert report["dead_letters"] == 1 == r.xlen(keys.dead_letter)
    assert running.worker.name[:28] in table.stdout and "dead letters: 1" in table.stdout
    batch_row = next(
        line.split() for line in table.stdout.splitlines() if line.startswith("128 ") and "batch" in line
    )
    assert batch_row[:3] == ["128", "batch", "2"]
