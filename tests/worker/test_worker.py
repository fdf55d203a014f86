"""A worker serving from Redis with a real tiny model: concurrent requests over several buckets
equal ``model.generate`` with exactly one terminal event each, whatever client sends them (the
sync and async clients, one that cannot tokenize, redis-cli by hand) and however tokens are
grouped into events; an idle worker stops promptly."""

import asyncio
import random
import subprocess
import threading
import time

import pytest
from conftest import assert_one_terminal, reply_events

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.producer import AsyncClient, Client
from tokenfleet.protocol import GROUP, Keys, smallest_bucket
from tokenfleet.worker.reading import IDLE_BLOCK_MS

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "queue",
    "stream",
    "token",
    "fleet",
    "batch",
    "cache",
    "block",
    "worker",
    "redis",
]


def mixed_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9))) for _ in range(n)]


@pytest.mark.parametrize(
    ("mode", "overlap_io"), [("dynamic", "auto"), ("continuous", "on"), ("continuous", "off")]
)
def test_concurrent_mixed_requests_over_buckets_match_generate(
    run_worker, redis_url, prefix, r, model_path, reference, mode, overlap_io
):
    batching = DynamicBatchingConfig(
        max_wait_ms=30, max_batch_size=8, max_seq_len=256, buckets=(16, 32, 64), mode=mode
    )
    prompts = mixed_prompts(24, seed=1)
    with run_worker(batching, overlap_io=overlap_io) as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        results = {}

        def submit_some(chunk):
            handles = [(p, client.submit(p, max_new_tokens=12)) for p in chunk]
            for p, h in handles:
                results[h.id] = (p, h.result(timeout=120))

        threads = [threading.Thread(target=submit_some, args=(prompts[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == len(prompts)
    buckets_used = {
        smallest_bucket(running.core.config.buckets, len(reference.ids(p))) for p, _ in results.values()
    }
    assert len(buckets_used) >= 2, "the workload should span several buckets"
    for request_id, (prompt, res) in results.items():
        assert res.token_ids == reference.greedy(reference.ids(prompt), 12), prompt
        assert res.usage["prompt_tokens"] == len(reference.ids(prompt))
        assert res.usage["completion_tokens"] == len(res.token_ids)
        assert 0 < res.usage.get("cached_tokens", 1) < res.usage["prompt_tokens"]  # present: a real hit
        assert_one_terminal(reply_events(r, prefix, request_id))
    assert max(running.prefill_sizes) > 1, "concurrent requests were never batched"
    assert max(b.size for b in running.batches if b.kind == "decode") > 1, "never decoded together"
    # everything acknowledged: nothing left pending in any group
    for bucket in batching.buckets:
        assert all(r.xpending(s, GROUP)["pending"] == 0 for s in Keys(prefix).queue_streams(bucket))


def test_async_client_streams_and_result_replays_later(run_worker, redis_url, prefix, model_path, reference):
    async def go():
        async with AsyncClient(redis_url, model=str(model_path), prefix=prefix) as client:
            handles = [await client.submit(p, max_new_tokens=8) for p in ("Hello", "a b c")]
            streamed = []
            for h in handles:
                streamed.append([c async for c in h.stream(timeout=60)])
            later = [await client.result(h.id, timeout=5) for h in handles]
            return handles, streamed, later

    with run_worker():
        handles, streamed, later = asyncio.run(go())
    for prompt, chunks, res in zip(("Hello", "a b c"), streamed, later):
        assert (
            [t for c in chunks for t in c.token_ids]
            == res.token_ids
            == reference.greedy(reference.ids(prompt), 8)
        )
        assert "".join(c.text for c in chunks) == res.text
    # a client that never submitted anything reads the same result from the request id alone
    other = Client(redis_url, prefix=prefix)
    assert other.result(handles[0].id, timeout=5).token_ids == later[0].token_ids


def test_stream_interval_sends_several_tokens_per_event_and_loses_none(
    run_worker, redis_url, prefix, r, model_path, reference
):
    prompts = ["Hello", "a b c", "queue stream token"]
    with run_worker(stream_interval_ms=10_000):
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        handles = [client.submit(p, max_new_tokens=24, ignore_eos=True) for p in prompts]
        results = [h.result(timeout=120) for h in handles]
    for prompt, handle, res in zip(prompts, handles, results):
        assert res.token_ids == reference.greedy(reference.ids(prompt), 24, ignore_eos=True)
        events = reply_events(r, prefix, handle.id)
        tokens = [e for e in events if e.type == "token"]
        # the first token goes at once (TTFT), the other 23 wait for the interval: the end sends them
        assert [len(e.ids) for e in tokens] == [1, 23]
        assert [e.index for e in tokens] == [0, 1]
        assert "".join(e.text for e in tokens) == res.text
        assert events[-1].type == "done"


def test_prompt_without_tokenizer_goes_through_auto_stream(run_worker, redis_url, prefix, r, reference):
    with run_worker():
        client = Client(redis_url, prefix=prefix)  # no model: cannot tokenize
        handle = client.submit("route me please", max_new_tokens=6)
        res = handle.result(timeout=60)
    assert res.token_ids == reference.greedy(reference.ids("route me please"), 6)
    assert r.xpending(Keys(prefix).auto_stream, GROUP)["pending"] == 0


def test_raw_redis_cli_producer_is_served(run_worker, redis_url, prefix, r, reference, redis_cli):
    """Enqueue exactly as docs/PROTOCOL.md shows, with redis-cli (no tokenfleet code)."""
    cli = redis_cli
    with run_worker():
        subprocess.run(
            [
                cli,
                "-u",
                redis_url,
                "XADD",
                Keys(prefix).auto_stream,
                "*",
                "v",
                "1",
                "id",
                "cli-42",
                "prompt",
                "Hello from the shell",
                "max_new_tokens",
                "5",
            ],
            check=True,
            capture_output=True,
        )
        out = subprocess.run(
            [
                cli,
                "-u",
                redis_url,
                "XREAD",
                "BLOCK",
                "30000",
                "STREAMS",
                Keys(prefix).reply_stream("cli-42"),
                "0",
            ],
            check=True,
            capture_output=True,
        )
        assert b"token" in out.stdout
        events = []
        for _ in range(100):
            events = reply_events(r, prefix, "cli-42")
            if events and events[-1].type == "done":
                break
            threading.Event().wait(0.1)
    assert_one_terminal(events)
    ids = [t for e in events if e.type == "token" for t in e.ids]
    assert ids == reference.greedy(reference.ids("Hello from the shell"), 5)


# a loaded CI machine's worst turn to notice the stop and tear down, beyond the idle read's block
STOP_SLACK_S = 10.0


def test_worker_with_nothing_to_do_stops_promptly(run_worker):
    """An idle worker blocks on Redis for at most IDLE_BLOCK_MS at a time, and checks for a stop
    between reads: asked to stop, its loop has returned within one such read plus slack."""
    with run_worker() as running:
        time.sleep(2 * IDLE_BLOCK_MS / 1000)  # set up, idle, and inside a blocking read
        running.assert_healthy()
        asked = time.monotonic()
        running.worker.stop()
        running.thread.join(timeout=60)
        took = time.monotonic() - asked
        assert not running.thread.is_alive(), "the idle worker did not stop within 60 s"
        assert took <= IDLE_BLOCK_MS / 1000 + STOP_SLACK_S, f"the idle worker took {took:.1f} s to stop"
