"""Client CPU per reply event: what one asyncio client pays to stream many requests at once.

A publisher process plays a worker: every ``--step-ms`` it writes one token event to each of
``--requests`` reply streams through the worker's own :class:`~tokenfleet.transport.outbox.Outbox`
(one script call per step), then a ``done`` event each. One
:class:`~tokenfleet.producer.AsyncClient` in this process streams all of them, as an API server
proxying its users would (the bench's end-to-end rows drive a worker the same way). Each round
reports the client's CPU time (``time.process_time``) per event; on a small host that CPU is
taken from the worker beside it. Prints a JSON line per round and a summary (the median round).
Never run as a test.

    python -m bench.client_events --requests 32 --steps 64 --step-ms 3 --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
import uuid


def publish(url: str, prefix: str, ids: list[str], steps: int, step_ms: float, go) -> None:
    """The worker's side: a token event per stream per step, then the terminal events."""
    import redis

    from tokenfleet.protocol import DoneEvent, Keys, TokenEvent
    from tokenfleet.transport.outbox import Outbox

    outbox = Outbox(redis.Redis.from_url(url), Keys(prefix))
    if not go.wait(timeout=600):
        return
    start = time.perf_counter()
    for step in range(steps):
        for rid in ids:
            outbox.event(rid, TokenEvent(step, [1000 + step], " tok"), 60 if step == 0 else None)
        outbox.flush()
        time.sleep(max(0.0, start + (step + 1) * step_ms / 1000 - time.perf_counter()))
    for rid in ids:
        outbox.event(rid, DoneEvent("length", 128, steps, {}, len(ids)), 60)
    outbox.flush()


async def one_round(client, ids: list[str], go) -> dict:
    async def follow(rid: str) -> int:
        return sum([len(chunk.token_ids) async for chunk in client.stream(rid, timeout=120)])

    cpu = time.process_time()
    tasks = [asyncio.create_task(follow(rid)) for rid in ids]
    await asyncio.sleep(0.2)  # every stream followed (the read blocked) before the first event
    follow_cpu = time.process_time() - cpu
    cpu, wall = time.process_time(), time.perf_counter()
    go.set()
    tokens = sum(await asyncio.gather(*tasks))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    events = tokens + len(ids)
    return {
        "events": events,
        "cpu_us_per_event": round(cpu / events * 1e6, 2),
        "cpu_share": round(cpu / wall, 3),
        "follow_cpu_ms": round(follow_cpu * 1000, 2),  # starting to follow them all
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32, help="reply streams followed at once")
    p.add_argument("--steps", type=int, default=64, help="token events per stream")
    p.add_argument("--step-ms", type=float, default=3.0, help="time between steps (a tiny model's step)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()

    from tokenfleet.producer import AsyncClient
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    rounds = []
    with EmbeddedRedis() as server:
        prefix = f"client-events-{uuid.uuid4().hex[:8]}"
        ctx = mp.get_context("spawn")
        go = ctx.Event()
        for round_no in range(args.rounds + 1):  # round 0 warms up
            ids = [f"r{round_no}-{i}" for i in range(args.requests)]
            publisher = ctx.Process(
                target=publish, args=(server.url, prefix, ids, args.steps, args.step_ms, go)
            )
            publisher.start()

            async def run(ids=ids) -> dict:
                async with AsyncClient(server.url, prefix=prefix) as client:
                    return await one_round(client, ids, go)

            row = asyncio.run(run())
            publisher.join()
            go.clear()
            if round_no:
                rounds.append(row)
                print(json.dumps({"round": round_no, **row}), flush=True)
    summary = {"requests": args.requests, "steps": args.steps, "step_ms": args.step_ms}
    for name in ("cpu_us_per_event", "follow_cpu_ms"):
        summary[name] = statistics.median(r[name] for r in rounds)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
