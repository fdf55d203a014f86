"""A Redis that may evict our keys is said loudly (refused with --strict-redis): by the worker, the
gateway and `tokenfleet status`, and in the metrics. Each test starts its own redis-server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest
import redis
from click.testing import CliRunner

from tokenfleet.cli.fleet import format_status
from tokenfleet.config import resolve_worker_config
from tokenfleet.gateway import watch
from tokenfleet.gateway.errors import APIError
from tokenfleet.gateway.models import Fleet
from tokenfleet.protocol import Keys
from tokenfleet.transport.server.embedded import EmbeddedRedis
from tokenfleet.transport.server.memory import EvictingRedis, check_memory_policy, read_memory_policy
from tokenfleet.transport.status import fleet_status

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("redis_server_binary")]

LRU = ("--maxmemory", "200mb", "--maxmemory-policy", "allkeys-lru")


@pytest.fixture
def evicting():
    with EmbeddedRedis(extra_args=LRU) as server:
        yield server


def test_the_policy_is_read_and_an_evicting_one_refused_when_strict(evicting, caplog):
    client = redis.Redis.from_url(evicting.url)
    policy = read_memory_policy(client)
    assert (policy.policy, policy.maxmemory, policy.evicting) == ("allkeys-lru", 200 << 20, True)
    with pytest.raises(EvictingRedis, match="allkeys-lru"):
        check_memory_policy(client, strict=True, who="worker w")
    with caplog.at_level("WARNING"):
        check_memory_policy(client, strict=False, who="worker w")
    assert "maxmemory-policy is allkeys-lru" in caplog.text
    client.config_set("maxmemory-policy", "noeviction")
    assert not read_memory_policy(client).evicting
    client.close()


def test_the_online_profile_is_strict_and_the_default_is_not():
    assert resolve_worker_config({}, environ={}, profile="online").redis.strict is True
    assert resolve_worker_config({}, environ={}).redis.strict is False
    flags = {"strict_redis": False}
    assert resolve_worker_config(flags, environ={}, profile="online").redis.strict is False


def test_status_shows_an_evicting_redis(evicting, prefix):
    client = redis.Redis.from_url(evicting.url)
    report = fleet_status(client, Keys(prefix))
    assert report["redis"] == {
        "maxmemory_policy": "allkeys-lru",
        "maxmemory": 200 << 20,
        "evicting": True,
        "out_of_memory": False,  # an evicting Redis makes room instead
    }
    assert "WARNING: redis maxmemory-policy is allkeys-lru" in format_status(report)
    client.config_set("maxmemory-policy", "noeviction")
    assert "WARNING" not in format_status(fleet_status(client, Keys(prefix)))
    client.close()


def test_a_strict_worker_refuses_to_start_and_a_lenient_one_warns(evicting, prefix, model_path):
    from conftest import worker_process

    strict = worker_process(
        str(model_path), evicting.url, prefix, "--strict-redis", stderr=subprocess.PIPE, text=True
    )
    _, err = strict.communicate(timeout=120)
    assert strict.returncode != 0
    assert "refuses to run (--strict-redis)" in err and "allkeys-lru" in err
    assert "Traceback" not in err

    lenient = worker_process(str(model_path), evicting.url, prefix, stderr=subprocess.PIPE, text=True)
    try:
        assert lenient.stderr is not None
        for line in lenient.stderr:  # the warning comes before the worker serves
            if "serving buckets" in line:
                pytest.fail("the worker served without warning of the eviction policy")
            if "maxmemory-policy is allkeys-lru" in line:
                break
    finally:
        lenient.terminate()
        lenient.communicate(timeout=60)


def test_the_gateway_refuses_when_strict_and_exports_the_policy(evicting, prefix, model_path):
    from gateway_process import Gateway

    strict = subprocess.run(
        [sys.executable, "-m", "tokenfleet", "serve", "--strict-redis", "--model", str(model_path)],
        env={"REDIS_URL": evicting.url, "TOKENFLEET_PREFIX": prefix, "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert strict.returncode != 0
    assert "gateway refuses to run (--strict-redis)" in strict.stderr, strict.stderr
    gateway = Gateway(evicting.url, prefix, str(model_path))
    try:
        metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
        assert "tokenfleet_redis_evicting 1.0" in metrics
        assert "maxmemory-policy is allkeys-lru" in gateway.output()
    finally:
        gateway.stop()


def test_a_full_redis_is_no_sign_that_the_workers_are_gone(prefix, monkeypatch):
    """Out of memory, Redis takes no heartbeats: the gateway answers 503 ``redis_full`` (not
    ``model_not_served``), keeps waiting on the requests it holds, and ``status`` warns; once there
    is room a fleet with no worker is one again."""
    monkeypatch.setattr(watch, "POLL_S", 0.1)
    monkeypatch.setattr(watch, "GRACE_S", 0.5)

    async def refusal(fleet: Fleet) -> tuple[int, str]:
        with pytest.raises(APIError) as refused:
            await fleet.require("m")
        return refused.value.status, refused.value.code

    async def drill(url: str, admin: redis.Redis) -> None:
        conn = redis.asyncio.Redis.from_url(url)
        assert await refusal(Fleet(conn, Keys(prefix))) == (503, "model_not_served")
        admin.config_set("maxmemory", "1")  # every write refused from now on
        full = Fleet(conn, Keys(prefix))
        assert await refusal(full) == (503, "redis_full")
        waiting = asyncio.ensure_future(watch.until_orphaned(full, "m"))
        await asyncio.sleep(2.0)  # four grace periods: quiet workers, yet not orphaned
        assert not waiting.done()
        admin.config_set("maxmemory", "0")
        await asyncio.wait_for(waiting, timeout=60)  # room again, and still no worker: orphaned
        await conn.aclose()

    with EmbeddedRedis(extra_args=("--maxmemory-policy", "noeviction")) as server:
        admin = redis.Redis.from_url(server.url)
        asyncio.run(drill(server.url, admin))
        admin.config_set("maxmemory", "1")
        report = fleet_status(admin, Keys(prefix))
        assert report["redis"]["out_of_memory"] is True
        assert "WARNING: redis is out of memory" in format_status(report)
        admin.config_set("maxmemory", "0")
        assert fleet_status(admin, Keys(prefix))["redis"]["out_of_memory"] is False
        admin.close()


def test_the_cli_help_explains_strict_redis():
    from tokenfleet.cli import main

    out = CliRunner().invoke(main, ["worker", "--help"]).output
    assert "--strict-redis" in out and "noeviction" in out


@pytest.mark.timeout(300)
def test_a_full_redis_refuses_new_requests_and_loses_none_it_accepted(runner, prefix, reference, tiny_model):
    """Redis reaches maxmemory (noeviction) while 24 requests stream: a new submit gets RedisFull
    in one line (the gateway's: 503 ``redis_full``), the worker keeps what it holds and publishes
    again once there is room, and every accepted request ends whole and correct (nothing
    acknowledged that was not written)."""
    from conftest import RunningWorker
    from gateway_process import Gateway

    from tokenfleet.config import DynamicBatchingConfig
    from tokenfleet.errors import RedisFull
    from tokenfleet.producer import Client

    batching = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=8, max_seq_len=512, buckets=(16, 64))
    prompts = [f"full {i}" for i in range(24)]
    with EmbeddedRedis(extra_args=("--maxmemory-policy", "noeviction")) as server:
        admin = redis.Redis.from_url(server.url)
        with RunningWorker(runner, server.url, prefix, batching, claim_idle_ms=3000) as running:
            client = Client(server.url, prefix=prefix, buckets=[16, 64])
            gateway = Gateway(server.url, prefix, tiny_model)
            model = httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            handles = [
                client.submit(input_ids=reference.ids(p), max_new_tokens=120, ignore_eos=True)
                for p in prompts
            ]
            first = iter(handles[0].stream(timeout=120))
            next(first)  # streaming
            first.close()
            used = int(admin.info("memory")["used_memory"])
            admin.config_set("maxmemory", str(used // 2))  # full: every write refused
            with pytest.raises(RedisFull, match="out of memory"):
                client.submit(input_ids=reference.ids("one more"), max_new_tokens=4)
            ask = {"model": model, "prompt": "one more", "max_tokens": 4}
            refused = httpx.post(gateway.url + "/v1/completions", json=ask, timeout=60)
            assert (refused.status_code, refused.json()["error"]["code"]) == (503, "redis_full")
            gateway.stop()
            time.sleep(3.0)  # the worker meets OOM on its writes and backs off, holding its work
            assert running.thread.is_alive()
            admin.config_set("maxmemory", "0")  # room again
            got = [h.result(timeout=180).token_ids for h in handles]
            expected = [reference.greedy(reference.ids(p), 120, ignore_eos=True) for p in prompts]
            assert got == expected
            running.assert_healthy()
            client.close()
        admin.close()
