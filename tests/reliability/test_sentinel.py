"""Redis Sentinel: a master, a replica and three Sentinels started here; the master is killed
mid-load and the worker, the client and the gateway follow the promoted replica."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import ErrorCode
from tokenfleet.transport.server.connection import SentinelURL, connect_client
from tokenfleet.transport.server.embedded import EmbeddedRedis, free_port

pytestmark = pytest.mark.integration
SERVICE = "fleet"


def test_sentinel_urls_parse():
    where = SentinelURL.parse("redis+sentinel://u:p%40ss@h1:26379,h2:26380/fleet/2")
    assert (where.sentinels, where.service, where.db) == ([("h1", 26379), ("h2", 26380)], "fleet", 2)
    assert (where.username, where.password, where.ssl) == ("u", "p@ss", False)
    assert SentinelURL.parse("rediss+sentinel://h1/fleet").ssl
    assert SentinelURL.parse("redis+sentinel://h1/fleet").sentinels == [("h1", 26379)]
    with pytest.raises(ValueError, match="service name"):
        SentinelURL.parse("redis+sentinel://h1:26379")


class Sentinels:
    """Three Sentinels watching ``master_port`` (quorum 2, down after 1 s)."""

    def __init__(self, binary: str, master_port: int):
        self.dir = tempfile.TemporaryDirectory(prefix="tokenfleet-sentinel-")
        self.ports = [free_port() for _ in range(3)]
        self.procs = []
        for port in self.ports:
            conf = Path(self.dir.name) / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir.name}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 5000\n"
            )
            self.procs.append(
                subprocess.Popen(
                    [binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.ports) + f"/{SERVICE}/0"

    def master_port(self) -> int | None:
        try:
            _, port = redis.Redis(port=self.ports[0]).sentinel_get_master_addr_by_name(SERVICE)
            return int(port)
        except (redis.RedisError, TypeError):
            return None

    def replicas_known(self) -> int:
        try:
            return len(redis.Redis(port=self.ports[0]).sentinel_slaves(SERVICE))
        except redis.RedisError:
            return 0

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(10)
        self.dir.cleanup()


def _wait(what, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def _replication(port: int) -> dict:
    """What a failure message needs to tell a lagging replica from a lost dataset."""
    try:
        server = redis.Redis(port=port)
        info = server.info("replication")
        return {k: info.get(k) for k in ("role", "master_link_status", "master_repl_offset")} | {
            "keys": server.dbsize()
        }
    except redis.RedisError as e:
        return {"error": str(e)}


@pytest.mark.timeout(300)
def test_worker_client_and_gateway_follow_a_failover(
    runner, prefix, reference, redis_server_binary, model_path
):
    from conftest import RunningWorker
    from gateway_process import Gateway

    from tokenfleet.config import DynamicBatchingConfig

    # no 5 s delay before the replica's first sync
    master = EmbeddedRedis(binary=redis_server_binary, extra_args=("--repl-diskless-sync-delay", "0")).start()
    replica = EmbeddedRedis(
        binary=redis_server_binary, extra_args=("--replicaof", "127.0.0.1", str(master.port))
    )
    replica.start()
    sentinels = Sentinels(redis_server_binary, master.port)
    gateway = None
    try:
        replica_client = redis.Redis(port=replica.port)
        _wait("the replica's sync", lambda: replica_client.info("replication")["master_link_status"] == "up")
        replica_client.close()
        _wait("the sentinels to see the replica", lambda: sentinels.replicas_known() >= 1)
        assert connect_client(sentinels.url).ping()
        batching = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=4, max_seq_len=512, buckets=(16, 64))
        prompts = [f"failover {i}" for i in range(12)]
        new = 60
        with RunningWorker(runner, sentinels.url, prefix, batching, claim_idle_ms=3000) as running:
            client = Client(sentinels.url, prefix=prefix, buckets=[16, 64])
            gateway = Gateway(sentinels.url, prefix, str(model_path))
            handles = [
                client.submit(input_ids=reference.ids(p), max_new_tokens=new, ignore_eos=True)
                for p in prompts
            ]
            first = iter(handles[0].stream(timeout=120))
            next(first)  # streaming
            first.close()
            # replication is asynchronous: under load the replica may trail, and what never reached
            # it is rightly lost, so make sure the queued requests did reach it before the kill
            old_master = redis.Redis(port=master.port)
            acked = old_master.wait(1, 10_000)
            old_master.close()
            assert acked == 1, f"the replica did not acknowledge the writes: {_replication(replica.port)}"
            os.kill(master.proc.pid, signal.SIGKILL)  # no goodbye: the Sentinels must notice
            _wait("the failover", lambda: sentinels.master_port() == replica.port)
            outcomes = []
            for p, h in zip(prompts, handles):
                try:
                    res = h.result(timeout=120)
                    expected = reference.greedy(reference.ids(p), new, ignore_eos=True)
                    outcomes.append("whole" if res.token_ids == expected else f"wrong {len(res.token_ids)}")
                except RequestFailed as e:
                    outcomes.append(e.code)
            assert all(o in ("whole", ErrorCode.LOST) for o in outcomes), outcomes
            # what reached the replica is served on
            assert "whole" in outcomes, (outcomes, _replication(replica.port))
            # one terminal event at most per request (fixed ids): none answered twice
            new_master = redis.Redis(port=replica.port)
            for h in handles:
                events = new_master.xrange(client.keys.reply_stream(h.id))
                assert sum(1 for entry_id, _ in events if entry_id.startswith(b"1-")) <= 1
            # all three follow the new master
            after = client.submit(input_ids=reference.ids("after"), max_new_tokens=8, ignore_eos=True)
            assert after.result(timeout=120).token_ids == reference.greedy(
                reference.ids("after"), 8, ignore_eos=True
            )
            api = gateway.openai(timeout=120)
            model = _wait("the worker's heartbeat", lambda: api.models.list().data)[0].id
            # OpenAI's default temperature is 1: the sampled tokens may hold EOS before the 4th
            answer = api.completions.create(model=model, prompt="after the failover", max_tokens=4)
            assert answer.choices[0].finish_reason in ("length", "stop")
            assert 1 <= answer.usage.completion_tokens <= 4
            running.assert_healthy()
            client.close()
    finally:
        if gateway is not None:
            gateway.stop()
        sentinels.stop()
        replica.stop()
        master.stop()
