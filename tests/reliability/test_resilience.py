"""A Redis restart under load, and a graceful SIGTERM while requests are held."""

import signal
import subprocess
import time

import pytest
from conftest import worker_process

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import Keys
from tokenfleet.transport.embedded import EmbeddedRedis

pytestmark = pytest.mark.usefixtures("redis_server_binary")


def test_redis_restart_under_load_every_request_ends(runner, tmp_path, prefix, reference):
    from conftest import RunningWorker

    server = EmbeddedRedis(
        extra_args=("--appendonly", "yes", "--appendfsync", "always"), data_dir=str(tmp_path)
    )
    server.start()
    batching = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=8, max_seq_len=512, buckets=(16, 64))
    prompts = [f"restart {i}" for i in range(12)]
    try:
        with RunningWorker(runner, server.url, prefix, batching, claim_idle_ms=2000) as running:
            client = Client(server.url, prefix=prefix, buckets=[16, 64])
            handles = [
                client.submit(input_ids=reference.ids(p), max_new_tokens=60, ignore_eos=True) for p in prompts
            ]
            first = handles[0]
            next(iter(first.stream(timeout=60)))  # under load: tokens are flowing
            server.stop()
            time.sleep(1.5)  # the worker meets connection errors and backs off
            server.start()
            outcomes = []
            for p, h in zip(prompts, handles):
                try:
                    res = h.result(timeout=120)
                    outcomes.append(
                        ("done", res.token_ids == reference.greedy(reference.ids(p), 60, ignore_eos=True))
                    )
                except RequestFailed as e:
                    outcomes.append(("error", e.code))
            running.assert_healthy()
    finally:
        server.stop()
    # none hangs forever; with an append-only file nothing is lost, so each one completes correctly
    assert outcomes == [("done", True)] * len(prompts), outcomes


def test_sigterm_finishes_what_is_held_and_leaves_the_rest(redis_url, prefix, r, tiny_model, reference):
    keys = Keys(prefix)
    worker = worker_process(
        tiny_model,
        redis_url,
        prefix,
        "--buckets",
        "16",
        "--max-wait-ms",
        "20",
        "--max-batch-size",
        "4",
        "--max-seq-len",
        "512",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        client = Client(redis_url, model=tiny_model, prefix=prefix, buckets=[16])
        held = [client.submit(f"held {i}", max_new_tokens=150, ignore_eos=True) for i in range(4)]
        next(iter(held[0].stream(timeout=120)))
        worker.send_signal(signal.SIGTERM)
        seen = []  # the worker's log up to the line saying its loop took the stop in: no read after it
        for line in worker.stdout:
            seen.append(line)
            if "stopping: taking no new work" in line:
                break
        later = [client.submit(f"later {i}", max_new_tokens=5) for i in range(2)]
        rest, _ = worker.communicate(timeout=120)
        logs = "".join(seen) + rest
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, logs[-2000:]
    for i, h in enumerate(held):
        res = h.result(timeout=5)
        assert res.finish_reason == "length"
        assert res.token_ids == reference.greedy(reference.ids(f"held {i}"), 150, ignore_eos=True)
    from tokenfleet.transport.status import queue_totals

    queue = queue_totals(r, keys.queue_streams(16), time.time())
    assert queue["pending"] == 0 and queue["depth"] == len(later)  # left for other workers, unread
