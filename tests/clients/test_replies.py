"""The asyncio client's one XREAD over every reply stream it follows, against a real Redis: each
follower gets its own entries in order, a new follower is not held up by a read already blocked,
and a client streaming many requests reads once per worker step, not once per request."""

import asyncio

import pytest
import redis.asyncio as aioredis

from tokenfleet import protocol
from tokenfleet.errors import ResultTimeout
from tokenfleet.producer import AsyncClient
from tokenfleet.producer.replies import ReplyReader
from tokenfleet.protocol import Keys, TokenEvent


def test_followers_get_their_own_entries_and_a_new_one_ends_a_blocked_read(redis_url, prefix):
    # a blocked read that ignored a new follower would hold it for READ_BLOCK_MS: make that 30 s
    keys = Keys(prefix)

    async def go():
        conn = aioredis.Redis.from_url(redis_url)
        reader = ReplyReader(conn, keys, give_up_s=5, read_block_ms=30_000)
        try:
            first = await reader.follow(keys.reply_stream("a"))
            await asyncio.sleep(0.2)  # the read is now blocked on stream a alone
            second = await reader.follow(keys.reply_stream("b"))
            await conn.xadd(keys.reply_stream("b"), {"n": 1})
            got_b = await asyncio.wait_for(second.get(), 5)
            for n in range(3):
                await conn.xadd(keys.reply_stream("a"), {"n": n})
            got_a = []
            while len(got_a) < 3:
                got_a += await asyncio.wait_for(first.get(), 5)
            assert await conn.exists(reader.wake_key)
            reader.unfollow(keys.reply_stream("a"))
            reader.unfollow(keys.reply_stream("b"))
            await reader.close()
            return got_a, got_b, await conn.exists(reader.wake_key)
        finally:
            await conn.aclose()

    got_a, got_b, wake_left = asyncio.run(go())
    assert [fields[b"n"] for _, fields in got_b] == [b"1"]
    assert [fields[b"n"] for _, fields in got_a] == [b"0", b"1", b"2"]
    assert not wake_left  # close() removes the client's wake-up stream


def test_followers_starting_together_share_one_wake_up(redis_url, prefix):
    # a follower left without a wake-up would wait out a blocked read of 30 s
    keys = Keys(prefix)
    streams = [keys.reply_stream(f"s{i}") for i in range(32)]

    async def go():
        conn = aioredis.Redis.from_url(redis_url)
        reader = ReplyReader(conn, keys, give_up_s=5, read_block_ms=30_000)
        pipelines = 0
        pipeline = conn.pipeline

        def counting_pipeline(*args, **kwargs):
            nonlocal pipelines
            pipelines += 1
            return pipeline(*args, **kwargs)

        conn.pipeline = counting_pipeline
        try:
            await reader.follow(keys.reply_stream("first"))
            await asyncio.sleep(0.2)  # the read is now blocked on the first stream alone
            inboxes = await asyncio.gather(*(reader.follow(s) for s in streams))
            for n, stream in enumerate(streams):
                await conn.xadd(stream, {"n": n})
            got = [await asyncio.wait_for(inbox.get(), 5) for inbox in inboxes]
            connections = len(conn.connection_pool._available_connections) + len(
                conn.connection_pool._in_use_connections
            )
            for stream in [keys.reply_stream("first"), *streams]:
                reader.unfollow(stream)
            await reader.close()
            return got, pipelines, connections
        finally:
            await conn.aclose()

    got, pipelines, connections = asyncio.run(go())
    assert [[fields[b"n"] for _, fields in entries] for entries in got] == [
        [str(n).encode()] for n in range(32)
    ]
    assert pipelines == 1  # one wake-up for the 32 followers, where each used to send its own
    assert connections <= 3  # the read's, the wake-up's, the writes': not one per follower


def test_a_client_streaming_many_requests_reads_once_per_step(
    run_worker, redis_url, prefix, model_path, reference
):
    prompts = ["Hello", "a b c", "queue", "stream token", "x y", "fleet", "redis", "zz"]
    new_tokens = 16

    async def go():
        async with AsyncClient(redis_url, model=str(model_path), prefix=prefix) as client:
            reads = 0
            xread = client.redis.xread

            async def counting_xread(*args, **kwargs):
                nonlocal reads
                reads += 1
                return await xread(*args, **kwargs)

            client.redis.xread = counting_xread
            handles = [await client.submit(p, max_new_tokens=new_tokens, ignore_eos=True) for p in prompts]

            async def follow(handle):
                return [t for chunk in [c async for c in handle.stream(timeout=120)] for t in chunk.token_ids]

            return await asyncio.gather(*(follow(h) for h in handles)), reads

    with run_worker():
        streamed, reads = asyncio.run(go())
    for prompt, tokens in zip(prompts, streamed):
        assert tokens == reference.greedy(reference.ids(prompt), new_tokens, ignore_eos=True), prompt
    # one read per request per token would be len(prompts) * new_tokens = 128
    assert reads <= 3 * new_tokens, reads


def test_async_events_time_out_when_nothing_comes(redis_url, prefix):
    async def go():
        async with AsyncClient(redis_url, prefix=prefix) as client:
            with pytest.raises(ResultTimeout):
                async for _ in client.events("never-submitted", timeout=0.3):
                    pass

    asyncio.run(go())


def test_async_events_time_out_after_the_events_that_came(redis_url, prefix, r):
    """A request whose worker went quiet mid-stream: its events are handed over, then the timeout."""
    request_id = "went-quiet"
    for index in range(2):
        event = TokenEvent(index, [7], "x")
        r.xadd(Keys(prefix).reply_stream(request_id), protocol.encode_event(event))

    async def go():
        got = []
        async with AsyncClient(redis_url, prefix=prefix) as client:
            with pytest.raises(ResultTimeout):
                async for event in client.events(request_id, timeout=0.5):
                    got.append(event.index)
        return got

    assert asyncio.run(go()) == [0, 1]


def test_two_readers_of_one_request_on_one_client_both_get_every_event(
    run_worker, redis_url, prefix, model_path, reference
):
    async def go():
        async with AsyncClient(redis_url, model=str(model_path), prefix=prefix) as client:
            handle = await client.submit("Hello", max_new_tokens=8)
            streamed, result = await asyncio.gather(
                handle.stream(timeout=60).__anext__(), handle.result(timeout=60)
            )
            rest = [t async for chunk in handle.stream(timeout=60) for t in chunk.token_ids]
            return streamed, result, rest

    with run_worker():
        first_chunk, result, replayed = asyncio.run(go())
    expected = reference.greedy(reference.ids("Hello"), 8)
    assert result.token_ids == replayed == expected
    assert first_chunk.token_ids == expected[: len(first_chunk.token_ids)]


def test_close_ends_a_read_at_once_even_when_the_first_cancel_is_lost(redis_url, prefix):
    # On Python 3.11 redis-py's wait_for around the send swallows a cancel that lands right after
    # the read starts; close() must not then sit out the read's whole block
    keys = Keys(prefix)

    async def go():
        conn = aioredis.Redis.from_url(redis_url)
        await conn.ping()
        try:
            closes = []
            for pause in (0.0, 0.0, 0.1):
                reader = ReplyReader(conn, keys, give_up_s=5, read_block_ms=30_000)
                await reader.follow(keys.reply_stream("a"))
                await asyncio.sleep(pause)  # 0: the read has just been sent
                started = asyncio.get_running_loop().time()
                await reader.close()
                closes.append(asyncio.get_running_loop().time() - started)
            return closes
        finally:
            await conn.aclose()

    assert max(asyncio.run(go())) < 2.0
