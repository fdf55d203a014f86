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
from tokenfleet.transport.embedded import EmbeddedRedis

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
def test_in_flight_requests_across_a_restart_without_persistence_never_end_short(
    engine, prefix, reference, redis_server_binary
):
    """Redis killed and restarted empty while four requests stream: each caller gets the whole,
    correct answer or `lost`, never fewer tokens reported as complete; the worker serves on."""
    from conftest import RunningWorker

    from tokenfleet.config import DynamicBatchingConfig

    server = EmbeddedRedis(binary=redis_server_binary).start()
    batching = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=4, max_seq_len=512, buckets=(16, 64))
    prompts = [f"lost {i}" for i in range(4)]
    new = 200
    try:
        with RunningWorker(engine, server.url, prefix, batching, claim_idle_ms=2000) as running:
            client = Client(server.url, prefix=prefix, buckets=[16, 64])
            handles = [
                client.submit(input_ids=reference.ids(p), max_new_tokens=new, ignore_eos=True)
                for p in prompts
            ]
            streams = [iter(h.stream(timeout=120)) for h in handles]
            for s in streams:
                next(s)  # every request is running and its caller has read a token
                s.close()
            server.stop()
            time.sleep(1.0)
            server.start()  # empty: no AOF, no RDB
            outcomes = []
            for p, h in zip(prompts, handles):
                try:
                    res = h.result(timeout=120)
                    expected = reference.greedy(reference.ids(p), new, ignore_eos=True)
                    outcomes.append("whole" if res.token_ids == expected else f"wrong {len(res.token_ids)}")
                except RequestFailed as e:
                    outcomes.append(e.code)
            assert all(o in ("whole", ErrorCode.LOST) for o in outcomes), outcomes
            after = client.submit(input_ids=reference.ids("after"), max_new_tokens=8, ignore_eos=True)
            assert after.result(timeout=120).token_ids == reference.greedy(
                reference.ids("after"), 8, ignore_eos=True
            )
            running.assert_healthy()
            client.close()
    finally:
        server.stop()
