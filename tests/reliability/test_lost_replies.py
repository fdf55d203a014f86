"""Redis losing part of a reply (a restart without persistence, a failover): a reader says `lost`
instead of returning a shorter answer as if it were complete."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenfleet import protocol
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import AsyncClient, Client
from tokenfleet.protocol import DoneEvent, ErrorCode, Keys, TokenEvent
from tokenfleet.transport.server.embedded import EmbeddedRedis

pytestmark = pytest.mark.integration


def _write(r, key: str, *events) -> None:
    for event in events:
        r.xadd(key, protocol.encode_event(event), id=event.stream_id)
    r.expire(key, 60)


def _done(completion_tokens: int) -> DoneEvent:
    return DoneEvent(finish_reason="length", prompt_tokens=3, completion_tokens=completion_tokens)


def _outcome(read) -> object:
    try:
        return read()
    except RequestFailed as e:
        return e.code


def test_a_hole_in_a_reply_is_lost_not_a_shorter_result(r, redis_url, prefix):
    keys = Keys(prefix)
    # tokens 0 and 3-4 survived, 1-2 did not (written to the old Redis, never read)
    _write(r, keys.reply_stream("hole"), TokenEvent(0, [5], "a"), TokenEvent(3, [6, 7], "bc"), _done(5))
    # every token event survived but the last ones before `done`
    _write(r, keys.reply_stream("tail"), TokenEvent(0, [5, 6], "ab"), _done(4))
    _write(r, keys.reply_stream("whole"), TokenEvent(0, [5], "a"), TokenEvent(1, [6, 7], "bc"), _done(3))
    # a retried write: an event repeating tokens already seen is no hole
    _write(
        r, keys.reply_stream("overlap"), TokenEvent(0, [5, 6], "ab"), TokenEvent(1, [6, 7], "bc"), _done(3)
    )
    with Client(redis_url, prefix=prefix) as client:
        got = {rid: _outcome(lambda rid=rid: client.result(rid, timeout=10)) for rid in ("hole", "tail")}
        assert got == {"hole": ErrorCode.LOST, "tail": ErrorCode.LOST}
        with pytest.raises(RequestFailed, match="tokens 1-2 of its reply are missing"):
            list(client.stream("hole", timeout=10))
        assert client.result("whole", timeout=10).token_ids == [5, 6, 7]
        assert client.result("overlap", timeout=10).token_ids == [5, 6, 7]

    async def read_async() -> dict[str, object]:
        client = AsyncClient(redis_url, prefix=prefix)
        try:
            out = {}
            for rid in ("hole", "tail", "whole"):
                try:
                    out[rid] = (await client.result(rid, timeout=10)).token_ids
                except RequestFailed as e:
                    out[rid] = e.code
            # a resumed stream starts past an entry: it checks from the first event it reads
            out["resumed"] = [
                e.index async for e in client.events("whole", 10, after="0-1") if not e.terminal
            ]
            return out
        finally:
            await client.close()

    assert asyncio.run(read_async()) == {
        "hole": ErrorCode.LOST,
        "tail": ErrorCode.LOST,
        "whole": [5, 6, 7],
        "resumed": [1],
    }


@pytest.mark.timeout(300)
def test_requests_across_a_restart_without_persistence_end_whole_or_lost(
    runner, prefix, reference, redis_server_binary
):
    """Redis killed and restarted empty while two requests stream and six wait (the sync client
    follows four, the asyncio client four): each caller gets the whole, correct answer or `lost`,
    never fewer tokens reported as complete, and none waits out its timeout; the worker serves
    on."""
    from conftest import RunningWorker

    from tokenfleet.config import DynamicBatchingConfig

    server = EmbeddedRedis(binary=redis_server_binary).start()
    batching = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=2, max_seq_len=512, buckets=(16, 64))
    prompts = [f"lost {i}" for i in range(8)]
    new = 200

    def outcome(prompt: str, token_ids: list[int]) -> str:
        expected = reference.greedy(reference.ids(prompt), new, ignore_eos=True)
        return "whole" if token_ids == expected else f"wrong {len(token_ids)}"

    async def follow_async(handles) -> list[str]:
        out = []
        for p, h in handles:
            try:
                out.append(outcome(p, (await h.result(timeout=90)).token_ids))
            except RequestFailed as e:
                out.append(e.code)
        return out

    async def submit_async(client) -> list:
        return [
            (p, await client.submit(input_ids=reference.ids(p), max_new_tokens=new, ignore_eos=True))
            for p in prompts[4:]
        ]

    try:
        with RunningWorker(runner, server.url, prefix, batching, claim_idle_ms=2000) as running:
            client = Client(server.url, prefix=prefix, buckets=[16, 64])
            handles = [
                client.submit(input_ids=reference.ids(p), max_new_tokens=new, ignore_eos=True)
                for p in prompts[:4]
            ]
            loop = asyncio.new_event_loop()
            aclient = AsyncClient(server.url, prefix=prefix, buckets=[16, 64])
            ahandles = loop.run_until_complete(submit_async(aclient))
            first = iter(handles[0].stream(timeout=120))
            next(first)  # the first batch is running
            first.close()
            server.stop()
            time.sleep(1.0)
            server.start()  # empty: no AOF, no RDB
            outcomes = []
            for p, h in zip(prompts, handles):
                try:
                    outcomes.append(outcome(p, h.result(timeout=90).token_ids))
                except RequestFailed as e:
                    outcomes.append(e.code)
            outcomes += loop.run_until_complete(follow_async(ahandles))
            assert all(o in ("whole", ErrorCode.LOST) for o in outcomes), outcomes
            assert ErrorCode.LOST in outcomes, outcomes  # the queued ones at least were lost
            after = client.submit(input_ids=reference.ids("after"), max_new_tokens=8, ignore_eos=True)
            assert after.result(timeout=120).token_ids == reference.greedy(
                reference.ids("after"), 8, ignore_eos=True
            )
            running.assert_healthy()
            client.close()
            loop.run_until_complete(aclient.close())
            loop.close()
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_the_gateway_answers_503_lost_when_redis_comes_back_empty(
    runner, prefix, reference, redis_server_binary, model_path
):
    """A whole and a streamed completion wait behind a long request on the only worker; Redis is
    restarted empty: both end with `lost` (503 whole, an error event streamed), not a hang."""
    import concurrent.futures

    import openai
    from conftest import RunningWorker
    from gateway_process import Gateway

    from tokenfleet.config import DynamicBatchingConfig

    server = EmbeddedRedis(binary=redis_server_binary).start()
    batching = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=1, max_seq_len=4096, buckets=(16, 64))
    gateway = None
    try:
        with RunningWorker(runner, server.url, prefix, batching, claim_idle_ms=2000) as running:
            client = Client(server.url, prefix=prefix, buckets=[16, 64])
            # the gateway first: its start-up (seconds under CI's load) must not use up `busy`
            gateway = Gateway(server.url, prefix, str(model_path), "--request-timeout-s", "600")
            api = gateway.openai(timeout=120)
            model = api.models.list().data[0].id
            # 4000 tokens at batch 1: seconds on any machine, so the two below surely wait
            busy = client.submit(input_ids=reference.ids("busy"), max_new_tokens=4000, ignore_eos=True)
            next(iter(busy.stream(timeout=120)))  # the only slot is taken
            ask = dict(model=model, prompt="queued", max_tokens=8)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                whole = pool.submit(api.completions.create, **ask)
                stream = pool.submit(lambda: list(api.completions.create(**ask, stream=True)))
                time.sleep(1.0)  # both enqueued, waiting behind `busy`
                server.stop()
                time.sleep(1.0)
                server.start()
                with pytest.raises(openai.APIStatusError) as waited:
                    whole.result(timeout=120)
                with pytest.raises(openai.APIError) as streamed:
                    stream.result(timeout=120)
            assert waited.value.status_code == 503 and waited.value.body["code"] == ErrorCode.LOST
            assert "lost" in str(streamed.value.body or streamed.value)
            running.assert_healthy()
            client.close()
    finally:
        if gateway is not None:
            gateway.stop()
        server.stop()


@pytest.mark.timeout(300)
def test_a_batch_job_across_a_restart_without_persistence_answers_every_line(
    runner, prefix, reference, redis_server_binary, tmp_path
):
    """`tokenfleet batch` (run_batch) of 32 lines, Redis restarted empty once results flow: the
    lines Redis lost go again on their own, and every line ends answered, correct, in order."""
    import json
    import threading

    from conftest import RunningWorker

    from tokenfleet.config import DynamicBatchingConfig
    from tokenfleet.producer.bulk import run_batch

    prompts, results = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    lines = [
        {"input_ids": reference.ids(f"line {i}"), "max_new_tokens": 16, "ignore_eos": True} for i in range(32)
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    server = EmbeddedRedis(binary=redis_server_binary).start()
    batching = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=4, max_seq_len=512, buckets=(16, 64))
    written = []
    try:
        with RunningWorker(runner, server.url, prefix, batching, claim_idle_ms=2000) as running:
            client = Client(server.url, prefix=prefix, buckets=[16, 64])
            counts: dict = {}
            job = threading.Thread(
                target=lambda: counts.update(
                    run_batch(client, str(prompts), str(results), window=16, progress=written.append)
                )
            )
            job.start()
            _until(lambda: len(written) >= 5)
            server.stop()
            time.sleep(1.0)
            server.start()  # empty
            job.join(timeout=240)
            assert not job.is_alive()
            running.assert_healthy()
            client.close()
    finally:
        server.stop()
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert counts == {"total": 32, "skipped": 0, "done": 32, "failed": 0}, counts
    assert [r["index"] for r in rows] == list(range(32))
    for i, row in enumerate(rows):
        assert row["token_ids"] == reference.greedy(reference.ids(f"line {i}"), 16, ignore_eos=True), i


def _until(check, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_bulk_submit_waits_for_redis_to_come_back(prefix, redis_server_binary):
    """A line submitted while Redis restarts waits for it (CI once lost a whole `tokenfleet batch`
    to one submit in the restart's second), and a request already submitted is not sent twice."""
    import threading

    from tokenfleet.producer.bulk import Job, _submit

    server = EmbeddedRedis(binary=redis_server_binary).start()
    try:
        client = Client(server.url, prefix=prefix, buckets=[16])
        job = Job([("away-1", {"input_ids": [1, 2, 3], "max_new_tokens": 2})])
        server.stop()
        back = threading.Timer(1.5, server.start)
        back.start()
        assert _submit(client, job) is None  # waited, then submitted
        back.join()
        assert _submit(client, job) is None  # already on its reply stream: skipped
        assert sum(client.redis.xlen(k) for k in client.redis.scan_iter(f"{{{prefix}}}:req:*")) == 1
        client.close()
    finally:
        server.stop()
