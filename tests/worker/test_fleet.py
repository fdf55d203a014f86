"""Scale out: several worker processes over overlapping bucket sets, several producer processes,
on a single Redis and on a real 3-node Redis Cluster. Every request completes exactly once."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import worker_process
from redis.cluster import RedisCluster

from tokenfleet import protocol
from tokenfleet.protocol import GROUP, Keys

REQUESTS = 500
NEW_TOKENS = 8
WORKER_BUCKETS = ["16,32", "32,64", "16,64"]  # every bucket served by two of the three workers
WORDS = ["queue", "stream", "token", "fleet", "batch", "cache", "block", "worker", "redis", "slot", "shard"]

PRODUCER = f"""
import json, sys
from tokenfleet.producer import Client
url, model, prefix, first, step = sys.argv[1:6]
prompts = json.loads(sys.stdin.read())
client = Client(url, model=model, prefix=prefix)
for i in range(int(first), len(prompts), int(step)):
    client.submit(prompts[i], max_new_tokens={NEW_TOKENS}, request_id=f"req-{{i}}")
"""


def prompt_pool() -> list[str]:
    rng = random.Random(7)
    pool = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 7))) for _ in range(40)]
    return [pool[i % len(pool)] for i in range(REQUESTS)]


@pytest.fixture(params=["single", "cluster"])
def fleet_url(request, redis_url):
    return redis_url if request.param == "single" else request.getfixturevalue("redis_cluster_url")


@pytest.mark.timeout(180)  # a minute or more on a busy 2-core machine
def test_many_workers_many_producers_every_request_once(fleet_url, prefix, tiny_model, reference, tmp_path):
    from tokenfleet.transport.server.connection import connect_client

    env = {**os.environ, "REDIS_URL": fleet_url, "TOKENFLEET_PREFIX": prefix, "OMP_NUM_THREADS": "1"}
    prompts = prompt_pool()
    logs = [open(tmp_path / f"w{i}.log", "w+") for i in range(3)]  # noqa: SIM115 (closed below)
    workers = [
        worker_process(
            tiny_model,
            fleet_url,
            prefix,
            "--buckets",
            buckets,
            "--name",
            f"w{i}",
            "--threads",
            "1",
            "--max-batch-size",
            "8",
            "--max-wait-ms",
            "10",
            "--max-seq-len",
            "256",
            env={"OMP_NUM_THREADS": "1"},
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i, buckets in enumerate(WORKER_BUCKETS)
    ]
    client = connect_client(fleet_url)
    try:
        deadline = time.monotonic() + 120  # a fleet is up once every worker has announced itself
        while client.hlen(Keys(prefix).workers) < len(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        producers = [
            subprocess.Popen(
                [sys.executable, "-c", PRODUCER, fleet_url, tiny_model, prefix, str(p), "4"],
                env=env,
                stdin=subprocess.PIPE,
                text=True,
            )
            for p in range(4)
        ]
        for proc in producers:
            proc.communicate(json.dumps(prompts), timeout=120)
            assert proc.returncode == 0
        from tokenfleet.producer import Client

        results = Client(fleet_url, prefix=prefix)
        served_by = {}
        for i, prompt in enumerate(prompts):
            res = results.result(f"req-{i}", timeout=300)
            assert res.token_ids == reference.greedy(reference.ids(prompt), NEW_TOKENS), prompt
            served_by[i] = res.worker
            events = [
                protocol.decode_event(f) for _, f in client.xrange(Keys(prefix).reply_stream(f"req-{i}"))
            ]
            assert [e.type for e in events].count("done") == 1 and len(events) == len(res.token_ids) + 1
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(60)
    assert [w.returncode for w in workers] == [0, 0, 0]
    assert set(served_by.values()) == {"w0", "w1", "w2"}, "some worker served nothing"
    finished = []
    for log in logs:
        log.seek(0)
        finished += [int(n) for n in re.findall(r"stopped after (\d+) requests", log.read())]
    assert sum(finished) == REQUESTS, f"requests served to completion: {finished} (a duplicate would add one)"
    keys = Keys(prefix)
    streams = [s for b in (16, 32, 64, "auto") for s in keys.queue_streams(b)]
    for stream in streams:
        if client.exists(stream):
            assert client.xpending(stream, GROUP)["pending"] == 0
    if isinstance(client, RedisCluster):
        slots = {client.keyslot(stream) for stream in streams}
        assert len(slots) == 1, "the request streams must share one slot"
        reply_nodes = {client.get_node_from_key(keys.reply_stream(f"req-{i}")).name for i in range(50)}
        assert len(reply_nodes) == 3, "reply streams should spread over every node"
    client.close()
    for log in logs:
        log.close()
