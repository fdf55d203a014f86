"""Clients from URLs: every connection they open tells Redis who it is without redis-py reading
its package metadata again (~0.4 ms a connection, paid per request of a burst before)."""

import asyncio

import redis.utils

from tokenfleet.transport.server.connection import connect_async_client, connect_client


def test_new_connections_do_not_read_package_metadata(redis_url, monkeypatch):
    reads = []
    real = redis.utils.get_lib_version
    monkeypatch.setattr(redis.utils, "get_lib_version", lambda: reads.append(1) or real())
    client = connect_client(redis_url)
    try:
        with client.pipeline(transaction=False) as one, client.pipeline(transaction=False) as two:
            one.ping()
            two.ping()
            assert one.execute() == [True] and two.execute() == [True]
    finally:
        client.close()

    async def go():
        aclient = connect_async_client(redis_url)
        try:  # concurrent commands: one connection each
            return await asyncio.gather(*(aclient.blpop(f"no-such-key-{i}", 0.1) for i in range(4)))
        finally:
            await aclient.aclose()

    assert asyncio.run(go()) == [None] * 4
    assert reads == []
