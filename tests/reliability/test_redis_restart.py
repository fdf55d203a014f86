"""Redis going away and coming back: a restart under load (with an append-only file) ends every
request correctly, and a worker started before its Redis waits for it and then serves. Each test
starts its own redis-server."""

import signal
import socket
import subprocess
import time

import pytest
import redis
from conftest import worker_process

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import Keys
from tokenfleet.transport.server.embedded import EmbeddedRedis

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_started_without_redis_waits_for_it(tiny_model, model_path, tmp_path, redis_server_binary):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    log = open(tmp_path / "worker.log", "w+")  # noqa: SIM115 (closed below)
    worker = worker_process(tiny_model, url, "tf-late", "--buckets", "16", stdout=log, stderr=log)
    server = None
    try:
        deadline = time.monotonic() + 120
        while "redis unavailable at start-up" not in (tmp_path / "worker.log").read_text():
            assert worker.poll() is None, "the worker exited without Redis"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert worker.poll() is None
        server = subprocess.Popen(
            [
                redis_server_binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
        )
        admin = redis.Redis.from_url(url)
        deadline = time.monotonic() + 120
        while True:
            try:
                if admin.hlen(Keys("tf-late").workers):
                    break
            except redis.ConnectionError:  # the server is still starting
                pass
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.2)
        client = Client(url, model=str(model_path), prefix="tf-late", buckets=[16])
        assert len(client.submit("late start", max_new_tokens=2).result(timeout=60).token_ids) == 2
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
        if server is not None:
            server.terminate()
            server.wait(10)
        log.close()
