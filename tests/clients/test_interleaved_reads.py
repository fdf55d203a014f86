"""One handle read many ways in turn: a few chunks of ``stream()``, a few ``events()``, then
``result()``, again and again under load, never reports a hole in the reply (``lost``) that Redis
did not make. The shared reply reader hands each reader only entries past the position that
reader asked for, also when a read in flight comes back after an unfollow and a new follow of
the same stream, in the sync and the asyncio client alike."""

from __future__ import annotations

import asyncio
import itertools
import random
from concurrent.futures import ThreadPoolExecutor

from tokenfleet.producer import AsyncClient, Client
from tokenfleet.producer.followed import FollowedStreams

ROUNDS = 200  # handles read in interleaved ways per client
NEW_TOKENS = 48


def test_a_read_sent_for_an_earlier_follow_hands_a_new_follow_nothing():
    followed: FollowedStreams = FollowedStreams("wake")
    first: list = []
    followed.add("s", "0", _Inbox(first))
    assert followed.to_read()[b"s"] == "0"
    followed.positions[b"s"] = b"5-0"  # the first reader has had entries up to 5-0
    asked = followed.to_read()  # a read goes out from 5-0 ...
    assert asked[b"s"] == b"5-0"
    followed.remove("s")  # ... its reader leaves, a new one starts from the beginning
    second: list = []
    followed.add("s", "0", _Inbox(second))
    followed.hand_over([(b"s", [(b"6-0", {}), (b"7-0", {})])])  # the old read's answer
    assert second == [] and first == []
    assert followed.to_read()[b"s"] == "0"  # the next read asks from the new reader's position
    followed.hand_over([(b"s", [(b"1-0", {}), (b"7-0", {})])])
    assert [entries[0][0] for entries in second] == [b"1-0"]


class _Inbox:
    def __init__(self, out: list):
        self.out = out

    def put_nowait(self, item) -> None:
        self.out.append(item)


def read_a_little_then_the_rest(handle, how: str) -> tuple[str, int]:
    """Read ``handle`` part way (``how``), then ask for its result; returns its text and tokens."""
    if how == "stream":
        for _ in zip(range(1), handle.stream()):
            pass
    elif how == "events":
        for _ in zip(range(2), handle.events()):
            pass
    result = handle.result(timeout=120)
    return result.text, len(result.token_ids)


def test_sync_handles_read_in_turns_under_load_never_see_lost(run_worker, redis_url, prefix, model_path):
    client = Client(redis_url, model=str(model_path), prefix=prefix)
    ways = itertools.cycle(["stream", "events", "result", "stream"])
    rng = random.Random(0)
    with run_worker(), ThreadPoolExecutor(16) as pool:
        handles = [
            client.submit(
                f"reader {i} " + "x" * rng.randint(1, 30), max_new_tokens=NEW_TOKENS, ignore_eos=True
            )
            for i in range(ROUNDS)
        ]
        done = list(pool.map(read_a_little_then_the_rest, handles, [next(ways) for _ in handles]))
        # and each again, from the start, on the same client: replayed whole
        again = [handle.result(timeout=60) for handle in handles[:20]]
    client.close()
    assert all(tokens == NEW_TOKENS for _, tokens in done)
    assert [r.text for r in again] == [text for text, _ in done[:20]]


def test_async_handles_read_in_turns_under_load_never_see_lost(run_worker, redis_url, prefix, model_path):
    async def read(handle, how: str) -> int:
        if how == "stream":
            async for _ in handle.stream():
                break
        elif how == "events":
            seen = 0
            async for _ in handle.events():
                seen += 1
                if seen == 3:
                    break
        return len((await handle.result(timeout=120)).token_ids)

    async def go() -> list[int]:
        client = AsyncClient(redis_url, model=str(model_path), prefix=prefix)
        try:
            ways = itertools.cycle(["stream", "events", "result"])
            handles = [
                await client.submit(f"async {i}", max_new_tokens=NEW_TOKENS, ignore_eos=True)
                for i in range(ROUNDS)
            ]
            return await asyncio.gather(*(read(h, next(ways)) for h in handles))
        finally:
            await client.close()

    with run_worker():
        counts = asyncio.run(go())
    assert counts == [NEW_TOKENS] * ROUNDS
