"""A worker that dies holding requests: another worker claims them (kill -9, or a consumer gone
without acknowledging), or it restarts under its own name and re-reads its own pending list; each
request resumes from the tokens already streamed, with no gap and no repeat, and ends with
``model.generate``'s tokens.

Real Redis, real tiny model. A "ghost" consumer stands for a worker that died holding entries."""

import signal
import subprocess
import time

import pytest
from conftest import reply_events, worker_process
from reliability_helpers import LONG, assert_clean_reply, ghost_takes

from tokenfleet import protocol
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, Keys, TokenEvent


def test_redelivered_request_resumes_from_streamed_tokens(
    run_worker, redis_url, prefix, r, model_path, reference
):
    keys = Keys(prefix)
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    prompt = "resume me"
    expected = reference.greedy(reference.ids(prompt), 20, ignore_eos=True)
    handle = client.submit(prompt, max_new_tokens=20, ignore_eos=True)
    stream = handle.stream_key  # its affinity shard of bucket 16
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    assert ghost_takes(r, stream)
    # the dead worker had streamed 7 tokens before it died
    for i, tok in enumerate(expected[:7]):
        ev = TokenEvent(i, [tok], "")
        r.xadd(keys.reply_stream(handle.id), protocol.encode_event(ev), id=ev.stream_id)
    with run_worker(LONG, claim_idle_ms=200) as running:
        res = handle.result(timeout=60)
        assert running.worker.reclaimed == 1
    assert res.token_ids == expected
    assert_clean_reply(reply_events(r, prefix, handle.id), expected)
    assert r.xpending(stream, GROUP)["pending"] == 0


def test_kill_9_mid_stream_second_worker_finishes_everything(
    run_worker, redis_url, prefix, r, tiny_model, model_path, reference
):
    prompts = ["one", "two two", "three three three", "four", "five five", "six"]
    new = 160
    keys = Keys(prefix)
    first = worker_process(
        tiny_model,
        redis_url,
        prefix,
        "--buckets",
        "16,64",
        "--max-wait-ms",
        "50",
        "--claim-idle-ms",
        "1000",
        "--max-seq-len",
        "4096",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        handles = [client.submit(p, max_new_tokens=new, ignore_eos=True) for p in prompts]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(r.xlen(keys.reply_stream(h.id)) >= 3 for h in handles):
                break
            time.sleep(0.01)
        else:
            pytest.fail("the first worker never streamed")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        partial = [r.xlen(keys.reply_stream(h.id)) for h in handles]
        assert all(n < new for n in partial), f"the first worker finished before the kill: {partial}"
        with run_worker(LONG, claim_idle_ms=1000) as second:
            results = [h.result(timeout=180) for h in handles]
            assert second.worker.reclaimed == len(prompts)
    finally:
        if first.poll() is None:
            first.kill()
    for p, h, res in zip(prompts, handles, results):
        expected = reference.greedy(reference.ids(p), new, ignore_eos=True)
        assert res.token_ids == expected
        assert_clean_reply(reply_events(r, prefix, h.id), expected)


def test_restart_under_the_same_name_resumes_its_own_pending_at_once(
    run_worker, redis_url, prefix, r, model_path, reference
):
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    handle = client.submit("mine", max_new_tokens=6)
    stream = handle.stream_key
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    r.xreadgroup(GROUP, "worker-7", {stream: ">"})  # a worker named worker-7 took it, then restarted
    # claim_idle_ms is long: only reading its own pending list can explain a prompt finish
    with run_worker(LONG, name="worker-7", claim_idle_ms=600_000):
        res = handle.result(timeout=30)
    assert res.token_ids == reference.greedy(reference.ids("mine"), 6)
