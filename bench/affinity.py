"""Prefix affinity in a fleet, side by side: the shared-prefix chat trace of ``bench.chat``
(``--chats`` chats share a system prompt; each turn re-sends every chat's whole history, all chats
at once) through worker processes with one thread each, every request carrying its chat's
``cache_key`` as an app passing OpenAI's ``prompt_cache_key`` would. Rows, taking turns round by
round:

- ``one-worker``: the cache hit rate one worker reaches on the trace (the ceiling);
- ``two-affinity``: two workers, affinity on (the default ``--steal-after-ms``);
- ``two-no-affinity``: two workers with ``--steal-after-ms 0`` (every worker reads every shard:
  the shared consumer group as it was);
- ``two-skewed``: two workers, affinity on, every chat on one key (one shard): the second
  worker must still work, by stealing.

Reported per row: prefix-cache hit rate (prompt tokens found cached / prompt tokens, from the
workers' heartbeats), tokens/s, TTFT p50 per turn, requests per worker. Never run as a test.

    python -m bench.affinity                          # the tiny model, 64 chats x 3 turns
    python -m bench.affinity --model DIR --dtype bfloat16 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Any

from bench.chat import Chat, make_chat
from bench.common import code_commit, host_kind, model_or_built, percentile, worker_process

ROWS = ("one-worker", "two-affinity", "two-no-affinity", "two-skewed")


def fleet_counts(client: Any) -> dict[str, dict[str, int]]:
    """Each live worker's prefix-cache counters and requests finished, from its heartbeat."""
    from tokenfleet.transport.registry import heartbeats

    return {
        b["name"]: {k: int(b.get(k, 0)) for k in ("prefix_cache_queries", "prefix_cache_hits", "finished")}
        for b in heartbeats(client.redis, client.keys)
        if b["alive"]
    }


def settled_counts(client: Any) -> dict[str, dict[str, int]]:
    """:func:`fleet_counts` once a heartbeat has come after the last request (one every 2 s)."""
    time.sleep(2.5)
    return fleet_counts(client)


def run_row(row: str, model_dir: str, dtype: str, chat: Chat, url: str) -> dict:
    from bench.chat import wave_through_threads
    from tokenfleet.producer import Client

    workers = 1 if row == "one-worker" else 2
    flags = ["--dtype", dtype, "--threads", "1"]
    if row == "two-no-affinity":
        flags += ["--steal-after-ms", "0"]
    prefix = f"affinity-{row}-{os.getpid()}-{time.monotonic_ns()}"
    env = {"OMP_NUM_THREADS": "1"}
    with contextlib.ExitStack() as stack:
        for _ in range(workers):
            stack.enter_context(worker_process(url, prefix, model_dir, flags, env=env))
        client = stack.enter_context(Client(url, model=model_dir, prefix=prefix))
        while len(fleet_counts(client)) < workers:
            time.sleep(0.2)
        time.sleep(2.5)  # every worker has seen the other's heartbeat and taken its shards
        client.submit(input_ids=[3, 4, 5], max_new_tokens=2, ignore_eos=True).result(timeout=300)
        before = settled_counts(client)
        keys = ["all-chats"] * chat.chats if row == "two-skewed" else [f"chat-{i}" for i in range(chat.chats)]
        waves: list[dict] = []
        answers: list[list[list[int]]] = []
        for turn in range(len(chat.users)):
            prompts = [chat.prompt(turn, i, answers) for i in range(chat.chats)]
            waves.append(wave_through_threads(client, prompts, chat.new_tokens, cache_keys=keys))
            answers.append(waves[-1]["token_ids"])
        after = settled_counts(client)
    delta = {
        name: {k: after[name][k] - before.get(name, {}).get(k, 0) for k in after[name]} for name in after
    }
    queries = sum(d["prefix_cache_queries"] for d in delta.values())
    hits = sum(d["prefix_cache_hits"] for d in delta.values())
    generated = sum(len(ids) for wave in waves for ids in wave["token_ids"])
    wall = sum(wave["wall_s"] for wave in waves)
    return {
        "system": row,
        "workers": workers,
        "chats": chat.chats,
        "turns": len(waves),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "prompt_tokens": queries,
        "cached_tokens": hits,
        "tokens_per_s": round(generated / wall, 1),
        "ttft_p50_ms": [round(percentile(wave["ttft_ms"], 50) or 0.0, 1) for wave in waves],
        "requests_per_worker": sorted(d["finished"] for d in delta.values()),
        "worker_flags": " ".join(flags),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local HF model dir (default: build the tiny model in a temp dir)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chats", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-len", type=int, default=256, help="shared system prompt, tokens")
    p.add_argument("--user-len", type=int, default=32, help="mean user message, tokens")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    model_dir = model_or_built(args.model)
    chat = make_chat(args.chats, args.system_len, args.user_len, args.turns, args.new_tokens, args.seed)
    rows = args.rows.split(",")
    by_round: list[dict[str, dict]] = []
    with EmbeddedRedis() as server:
        for rnd in range(args.rounds):
            results = {}
            for row in rows[rnd % len(rows) :] + rows[: rnd % len(rows)]:  # rows take turns
                results[row] = run_row(row, model_dir, args.dtype, chat, server.url)
                print(json.dumps({"round": rnd, **results[row]}), flush=True)
            by_round.append(results)
    summary: dict[str, Any] = {
        "summary": True,
        "host": host_kind(),
        "commit": code_commit(),
        "rounds": args.rounds,
    }
    for row in rows:
        summary[f"{row}_hit_rate"] = statistics.median(r[row]["prefix_cache_hit_rate"] for r in by_round)
    if "one-worker" in rows:
        for row in rows:
            ratios = [
                r[row]["prefix_cache_hit_rate"] / r["one-worker"]["prefix_cache_hit_rate"] for r in by_round
            ]
            summary[f"{row}_hit_rate_vs_one_worker"] = round(statistics.median(ratios), 3)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
