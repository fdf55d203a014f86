"""ACLs applied on a real Redis (each role can do its job and nothing else) and TLS connections."""

import asyncio
import shutil
import subprocess
import time

import pytest
import redis

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import AsyncClient, Client
from tokenfleet.protocol import ErrorCode, Keys
from tokenfleet.transport.server.acl import acl_rules
from tokenfleet.transport.server.embedded import EmbeddedRedis, answers, find_server_binary, free_port

pytestmark = pytest.mark.usefixtures("redis_server_binary")
BATCHING = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=256, buckets=(16, 64))


@pytest.fixture
def acl_server(prefix):
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        for args in acl_rules(prefix, "prod-secret", "work-secret", "mon-secret"):
            admin.execute_command("ACL", "SETUSER", *args)
        yield server, admin
        admin.close()


def url_as(server, user, password):
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def test_each_role_does_its_job_through_acls(acl_server, runner, prefix, model_path, reference):
    from conftest import RunningWorker

    server, admin = acl_server
    worker_url = url_as(server, "tokenfleet-worker", "work-secret")
    producer_url = url_as(server, "tokenfleet-producer", "prod-secret")
    with RunningWorker(runner, worker_url, prefix, BATCHING, max_queue=100):
        client = Client(producer_url, model=str(model_path), prefix=prefix)
        res = client.submit("acl", max_new_tokens=5).result(timeout=60)
        assert res.token_ids == reference.greedy(reference.ids("acl"), 5)
        with pytest.raises(RequestFailed) as unknown:  # the adapter registry, read under the worker's rights
            client.submit("acl", max_new_tokens=3, adapter="nobody").result(timeout=60)
        assert unknown.value.code == ErrorCode.ADAPTER_UNAVAILABLE
        long = client.submit("cancel", max_new_tokens=200, ignore_eos=True)
        next(iter(long.stream(timeout=60)))
        long.cancel()
        assert long.result(timeout=30).finish_reason == "cancelled"
        # the worker routes auto entries and dead-letters junk under its own rights too
        raw_producer = redis.Redis.from_url(producer_url)
        raw_producer.xadd(Keys(prefix).auto_stream, {"id": "acl-auto", "prompt": "hi", "max_new_tokens": "3"})
        raw_producer.xadd(Keys(prefix).request_stream(16), {"m": b"\xc1"})
        assert len(client.result("acl-auto", timeout=60).token_ids) == 3
        deadline = time.monotonic() + 10
        while not admin.xlen(Keys(prefix).dead_letter) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert admin.xlen(Keys(prefix).dead_letter) == 1

        async def stream_two():  # the asyncio client: one read over both, its wake-up stream
            async with AsyncClient(producer_url, model=str(model_path), prefix=prefix) as aclient:
                handles = [await aclient.submit(p, max_new_tokens=4) for p in ("acl", "async")]
                return await asyncio.gather(*(h.result(timeout=60) for h in handles))

        for prompt, result in zip(("acl", "async"), asyncio.run(stream_two())):
            assert result.token_ids == reference.greedy(reference.ids(prompt), 4)


def test_producer_is_refused_outside_its_role(acl_server, prefix):
    server, admin = acl_server
    keys = Keys(prefix)
    admin.xgroup_create(keys.request_stream(16), "workers", id="0", mkstream=True)
    admin.xadd(keys.dead_letter, {"x": "1"})
    p = redis.Redis.from_url(url_as(server, "tokenfleet-producer", "prod-secret"))
    refused = [
        lambda: p.xreadgroup("workers", "me", {keys.request_stream(16): ">"}),  # taking work
        lambda: p.xack(keys.request_stream(16), "workers", "0-1"),
        lambda: p.xadd(keys.reply_stream("forged"), {"type": "done"}),  # forging replies
        lambda: p.xrange(keys.dead_letter),  # reading others' dead letters
        lambda: p.delete(keys.request_stream(16)),
        lambda: p.expire(keys.request_stream(16), 1),  # expire/del only on its wake-up streams
        lambda: p.set("elsewhere", 1),  # keys outside the prefix
        lambda: p.flushall(),
        lambda: p.config_get("*"),
        lambda: p.keys("*"),
    ]
    for call in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()


def test_worker_is_refused_outside_its_role(acl_server, prefix):
    server, _ = acl_server
    w = redis.Redis.from_url(url_as(server, "tokenfleet-worker", "work-secret"))
    refused = [
        lambda: w.set(Keys(prefix).cancel("x"), 1),  # cancelling is the producers' right
        lambda: w.set("elsewhere", 1),
        lambda: w.get("other-app:secret"),
        lambda: w.flushall(),
        lambda: w.config_set("appendonly", "no"),
        lambda: w.keys("*"),
        lambda: w.delete(Keys(prefix).request_stream(16)),
    ]
    for call in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(url_as(server, "tokenfleet-worker", "wrong")).ping()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_rediss_tls_url_serves_requests(runner, tmp_path, prefix, model_path, reference):
    from conftest import RunningWorker

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            find_server_binary(),
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    try:
        for _ in range(100):
            if answers(url):
                break
            time.sleep(0.05)
        else:
            pytest.skip("this redis-server was built without TLS")
        with RunningWorker(runner, url, prefix, BATCHING):
            client = Client(url, model=str(model_path), prefix=prefix)
            assert client.submit("tls", max_new_tokens=4).result(timeout=60).token_ids == reference.greedy(
                reference.ids("tls"), 4
            )
        assert not answers(f"redis://127.0.0.1:{port}/0")  # plain text is refused
    finally:
        proc.terminate()
        proc.wait(10)


def test_operations_doc_shows_the_rules_the_code_applies():
    import shlex
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "operations" / "secure.md").read_text()
    for args in acl_rules("tokenfleet", "P", "W", "M"):
        assert "ACL SETUSER " + " ".join(shlex.quote(a) for a in args) in doc


def test_the_monitor_reads_the_fleet_and_nothing_more(acl_server, runner, prefix):
    from conftest import RunningWorker

    from tokenfleet.transport.status import fleet_status

    server, admin = acl_server
    worker_url = url_as(server, "tokenfleet-worker", "work-secret")
    monitor = redis.Redis.from_url(url_as(server, "tokenfleet-monitor", "mon-secret"))
    with RunningWorker(runner, worker_url, prefix, BATCHING):
        report = fleet_status(monitor, Keys(prefix))
        assert [w["alive"] for w in report["workers"]] == [True]
        for refused in (
            lambda: monitor.xadd(Keys(prefix).request_stream(16), {"id": "x"}),
            lambda: monitor.set(f"{prefix}:cancel:x", 1),
            lambda: monitor.delete(Keys(prefix).workers),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
    monitor.close()


def test_producer_commands_all_run_under_the_producer_role(acl_server, runner, prefix, model_path, tmp_path):
    """submit (with its "is anyone serving" check), result, cancel and batch, as the CLI runs
    them, with the producer's rights only."""
    import subprocess
    import sys

    from conftest import RunningWorker

    server, _ = acl_server
    worker_url = url_as(server, "tokenfleet-worker", "work-secret")
    env = {
        **__import__("os").environ,
        "REDIS_URL": url_as(server, "tokenfleet-producer", "prod-secret"),
        "TOKENFLEET_PREFIX": prefix,
    }
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('"one"\n{"prompt": "two", "max_new_tokens": 3}\n')

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "tokenfleet", *args], env=env, capture_output=True, text=True, timeout=120
        )

    with RunningWorker(runner, worker_url, prefix, BATCHING):
        submitted = cli(
            "submit", "--model", str(model_path), "--max-new-tokens", "3", "--id", "acl-cli", "hi"
        )
        assert submitted.returncode == 0, submitted.stderr
        assert "request acl-cli" in submitted.stderr and "no live worker" not in submitted.stderr
        assert cli("result", "acl-cli").returncode == 0
        assert cli("cancel", "acl-cli").returncode == 0
        batch = cli("batch", str(prompts), "-o", str(tmp_path / "out.jsonl"), "--max-new-tokens", "2")
        assert batch.returncode == 0, batch.stderr


def test_a_gateway_under_the_producer_role_refuses_adapter_changes_plainly(
    acl_server, prefix, model_path, tmp_path
):
    """The producer role only reads the adapter registry: a gateway running under it answers an
    admin's load_lora_adapter with a 403 that says what to do, not a 500."""
    import httpx
    from gateway_process import Gateway

    server, admin = acl_server
    producer_url = url_as(server, "tokenfleet-producer", "prod-secret")
    gateway = Gateway(producer_url, prefix, str(model_path), "--admin-keys", "adm")
    try:
        body = {"lora_name": "support", "lora_path": str(tmp_path), "base_model_name": "tiny"}
        answer = httpx.post(
            gateway.url + "/v1/load_lora_adapter",
            json=body,
            headers={"Authorization": "Bearer adm"},
            timeout=30,
        )
        assert answer.status_code == 403, answer.text
        assert "tokenfleet lora add" in answer.json()["error"]["message"]
        assert not admin.exists(Keys(prefix).adapters)
    finally:
        gateway.stop()
