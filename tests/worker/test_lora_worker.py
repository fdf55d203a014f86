"""Adapters through the fleet: a request names an adapter the fleet's registry knows (a worker's
``--lora``, ``tokenfleet lora add``, the gateway's load endpoint), the worker loads it beside its
steps and answers as PEFT would; an unknown one is ``adapter_unavailable``; a worker killed -9
mid-generation hands the request to another, which resumes it with the same adapter, equal to an
uninterrupted run; at the gateway openai-python asks for the adapter as its ``model``."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import openai
import pytest
from click.testing import CliRunner
from conftest import make_runner, worker_process
from lora_adapters import ALL, PeftReference, make_adapter

from tokenfleet.cli import main
from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import ErrorCode, Keys
from tokenfleet.protocol.adapters import AdapterRecord
from tokenfleet.transport.status import fleet_status

BATCHING = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=8, max_seq_len=4096, buckets=(16, 64))
MODEL = "tiny"


@pytest.fixture(scope="module")
def runner(tiny_model):
    """A runner of this module's own (``run_worker`` takes it): the adapters these tests load stay
    out of the session's shared runner, whose workers other tests read (no adapters resident)."""
    return make_runner(
        tiny_model, device="cpu", dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=2048)
    )


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "support": make_adapter(tiny_model, root / "support", 8, ["q_proj", "v_proj"], seed=1),
        "legal": make_adapter(tiny_model, root / "legal", 16, ALL, seed=2),
    }


@pytest.fixture(scope="module")
def peft(tiny_model) -> PeftReference:
    return PeftReference(tiny_model)


def register(r, prefix: str, name: str, path: str) -> None:
    r.hset(Keys(prefix).adapters, name, AdapterRecord(name, path, MODEL).to_json())


def test_requests_name_adapters_the_registry_knows(
    run_worker, redis_url, prefix, r, model_path, adapter_dirs, peft, reference
):
    register(r, prefix, "support", adapter_dirs["support"])
    with run_worker(BATCHING, served_model_name=MODEL) as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        ids = reference.ids("Hello adapters")
        handles = [
            client.submit(input_ids=ids, max_new_tokens=8, ignore_eos=True, adapter=a)
            for a in ("support", None)
        ]
        with pytest.raises(RequestFailed) as unknown:
            client.submit(input_ids=ids, max_new_tokens=8, adapter="nobody").result(timeout=60)
        assert unknown.value.code == ErrorCode.ADAPTER_UNAVAILABLE and "nobody" in unknown.value.message
        got = [h.result(timeout=60).token_ids for h in handles]
        assert got == [peft.greedy(adapter_dirs["support"], ids, 8), peft.greedy(None, ids, 8)]
        # added while the worker serves, with the CLI: no restart
        added = CliRunner().invoke(
            main,
            [
                "lora",
                "add",
                "legal",
                adapter_dirs["legal"],
                "--base",
                MODEL,
                "--prefix",
                prefix,
                "--redis-url",
                redis_url,
            ],
        )
        assert added.exit_code == 0, added.output
        legal = client.submit(input_ids=ids, max_new_tokens=8, ignore_eos=True, adapter="legal").result(
            timeout=60
        )
        assert legal.token_ids == peft.greedy(adapter_dirs["legal"], ids, 8)
        running.assert_healthy()
        assert set(running.core.capacity().adapters) == {"support", "legal"}
        listed = CliRunner().invoke(main, ["lora", "list", "--prefix", prefix, "--redis-url", redis_url])
        assert "legal" in listed.output and "support" in listed.output


@pytest.mark.timeout(300)
def test_a_worker_killed_mid_generation_hands_the_adapter_request_on(
    run_worker, redis_url, prefix, r, tiny_model, model_path, adapter_dirs, peft, reference
):
    """The first worker serves it with ``--lora``; kill -9; the second, which has never seen the
    adapter, takes the request over, loads the adapter and resumes: the whole reply equals PEFT's."""
    first = worker_process(
        tiny_model,
        redis_url,
        prefix,
        *("--served-model-name", MODEL, "--lora", f"legal={adapter_dirs['legal']}", "--buckets", "16,64"),
        *("--claim-idle-ms", "1000", "--max-seq-len", "4096"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    new = 200
    try:
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        deadline = time.monotonic() + 120
        while not r.hexists(Keys(prefix).adapters, "legal") and time.monotonic() < deadline:
            time.sleep(0.1)
        ids = reference.ids("resume me with my adapter")
        handle = client.submit(input_ids=ids, max_new_tokens=new, ignore_eos=True, adapter="legal")
        while r.xlen(Keys(prefix).reply_stream(handle.id)) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert r.xlen(Keys(prefix).reply_stream(handle.id)) < new, "finished before the kill"
        with run_worker(BATCHING, served_model_name=MODEL, claim_idle_ms=1000) as second:
            result = handle.result(timeout=180)
            assert second.worker.reclaimed == 1
    finally:
        if first.poll() is None:
            first.kill()
    assert result.token_ids == peft.greedy(adapter_dirs["legal"], ids, new)


def test_openai_python_asks_for_an_adapter_as_its_model(run_worker, gateways, adapter_dirs, peft, reference):
    with run_worker(BATCHING, served_model_name=MODEL):
        gateway = gateways("--admin-keys", "admin-secret")
        body = {"lora_name": "support", "lora_path": adapter_dirs["support"]}
        load = gateway.url + "/v1/load_lora_adapter"
        refused = httpx.post(load, json=body, timeout=30)  # it points workers at their disks: admins only
        assert refused.status_code == 403 and "admin key" in refused.json()["error"]["message"]
        admin = {"Authorization": "Bearer admin-secret"}
        loaded = httpx.post(load, json=body, headers=admin, timeout=30)
        assert loaded.status_code == 200, loaded.text
        client = gateway.openai()
        listed = {m.id: m for m in client.models.list().data}
        assert listed["support"].parent == MODEL and listed[MODEL].parent is None
        prompt = "Hello adapters"
        out = client.completions.create(model="support", prompt=prompt, max_tokens=8, temperature=0)
        assert out.model == "support"
        ids = reference.ids(prompt)
        assert out.choices[0].token_ids == peft.greedy(adapter_dirs["support"], ids, 8)
        streamed = client.completions.create(
            model="support", prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        assert [t for c in streamed for t in c.choices[0].token_ids] == out.choices[0].token_ids
        unloaded = httpx.post(
            gateway.url + "/v1/unload_lora_adapter", json={"lora_name": "support"}, headers=admin, timeout=30
        )
        assert unloaded.status_code == 200
        time.sleep(2.5)  # the gateway's view of the registry is a moment old
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="support", prompt=prompt, max_tokens=4)


@pytest.mark.timeout(300)
def test_an_adapter_added_at_run_time_is_served_by_every_worker_of_the_base(
    run_worker, redis_url, prefix, r, tiny_model, model_path, adapter_dirs, peft, reference
):
    """Two live workers, then `tokenfleet lora add`: requests for the new adapter spread by their
    cache keys over both workers' shards, and each worker answers some of them, as PEFT would."""
    other = worker_process(
        tiny_model,
        redis_url,
        prefix,
        *("--served-model-name", MODEL, "--buckets", "16,64", "--max-seq-len", "4096"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with run_worker(BATCHING, served_model_name=MODEL) as running:
            deadline = time.monotonic() + 120

            def owners() -> int:  # workers that own shards of the buckets (requests go by shard)
                running.worker.upkeep.heartbeat(force=True)
                return sum(w["shards_owned"] > 0 for w in fleet_status(r, Keys(prefix))["workers"])

            while owners() < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert owners() == 2, "the second worker never took shards"
            flags = ["--base", MODEL, "--prefix", prefix, "--redis-url", redis_url]
            added = CliRunner().invoke(main, ["lora", "add", "legal", adapter_dirs["legal"], *flags])
            assert added.exit_code == 0, added.output
            client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
            ids = reference.ids("every worker")
            handles = [
                client.submit(
                    input_ids=ids, max_new_tokens=4, ignore_eos=True, adapter="legal", cache_key=f"k{i}"
                )
                for i in range(24)
            ]
            results = [h.result(timeout=120) for h in handles]
            running.assert_healthy()
    finally:
        other.kill()
        other.wait(10)
    assert len({res.worker for res in results}) == 2, [res.worker for res in results]
    assert all(res.token_ids == peft.greedy(adapter_dirs["legal"], ids, 4) for res in results)
