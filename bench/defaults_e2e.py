"""tokenfleet end to end as a user runs it, for ``bench.compare``'s ``tokenfleet-defaults-*`` rows.

The worker gets the README's flags and nothing else: ``--model`` and ``--dtype`` (buckets, batch
size, wait, prefill sizes, compilation and the allocator are the worker's own defaults and
choices; the bench preloads nothing). The requests come through the clients users write:

- ``threads``: the sync :class:`~tokenfleet.producer.Client`, one thread per request sharing one
  client, as a web app's worker threads would (redis-py hands each thread its own connection
  from a pool, warm here as in an app that has served before);
- ``asyncio``: one :class:`~tokenfleet.producer.AsyncClient` for every request (an API server
  proxying its users; it follows every reply stream with one XREAD);
- ``asyncio-each``: an ``AsyncClient`` per request, each following its own reply stream.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence

from bench.common import worker_process
from bench.rows_tokenfleet import CpuCounters, drive_clients
from bench.workload import Req, Trace, summarize

CLIENT_MODES = ("threads", "asyncio", "asyncio-each")


def run_defaults(model_dir: str, dtype: str, reqs: list[Req], client: str) -> dict:
    """One ``tokenfleet-defaults-<client>`` row: a worker on the README's flags, on its own Redis."""
    from tokenfleet.producer import AsyncClient
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    prefix = f"defaults-{os.getpid()}"
    flags = ["--dtype", dtype]
    with EmbeddedRedis() as server, worker_process(server.url, prefix, model_dir, flags) as worker:
        counters = CpuCounters(server.url, worker.pid)
        if client == "threads":
            traces, wall = drive_threads(server.url, model_dir, prefix, reqs, counters)
        else:
            shared = client == "asyncio"
            traces, wall = asyncio.run(
                drive_clients(server.url, model_dir, prefix, reqs, AsyncClient, shared, counters)
            )
    note = f"worker flags: --dtype {dtype} (the README's); {len(reqs)} requests, client: {client}"
    return {**summarize(f"tokenfleet-defaults-{client}", traces, wall, note), **counters.used}


def drive_threads(
    url: str,
    model_dir: str,
    prefix: str,
    reqs: list[Req],
    counters: CpuCounters,
    adapters: Sequence[str | None] = (),
) -> tuple[list[Trace], float]:
    """Each request on a thread of its own through one shared sync client, submitted at its
    arrival time and streamed token by token (``adapters``: each request's, where given)."""
    from tokenfleet.producer import Client

    traces = [Trace(0.0) for _ in reqs]
    ends = [0.0] * len(reqs)
    with Client(url, model=model_dir, prefix=prefix) as client:
        client.submit(input_ids=[3, 4, 5], max_new_tokens=2, ignore_eos=True).result(timeout=300)
        warm_pool(client, len(reqs))
        start = time.perf_counter() + 0.5  # every thread started before the first arrival

        def one(i: int) -> None:
            req, trace = reqs[i], traces[i]
            time.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            trace.arrival = time.perf_counter()
            adapter = adapters[i] if adapters else None
            handle = client.submit(
                input_ids=req.prompt_ids, max_new_tokens=req.max_new_tokens, ignore_eos=True, adapter=adapter
            )
            for chunk in handle.stream(timeout=600):
                now = time.perf_counter()
                trace.token_ids.extend(chunk.token_ids)
                trace.token_times.extend([now] * len(chunk.token_ids))
            ends[i] = time.perf_counter()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
        counters.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        counters.stop()
    return traces, max(ends) - start


def warm_pool(client, connections: int) -> None:
    """A connection per thread already open, as in a web app that has served before: a cold
    thread's first command opens one (a TCP handshake and HELLO), which on 2 vCPUs spread a
    burst's submissions past the worker's 50 ms batch window."""
    pool = client.redis.connection_pool
    opened = [pool.get_connection() for _ in range(connections)]
    for connection in opened:
        connection.connect()
        pool.release(connection)
