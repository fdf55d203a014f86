"""Scaling benchmark: the same workload through 1, 2 and 4 worker processes, side by side.

Starts its own Redis (so INFO commandstats counts only this run), builds the tiny model if no
``--model`` is given, and for each fleet size: starts the workers (``--threads`` each), waits
until they announce themselves, enqueues every request at once, waits for every result, then
stops the workers and reads where their time went. Prints one JSON line per fleet size and a
summary with throughput ratios against one worker. Never run as a test.

On a 2-core machine this measures coordination overhead (idle time waiting on Redis, Redis
commands per generated token), not accelerator scaling.

    python -m bench.scaling
    python -m bench.scaling --workers 1,2,4 --requests 256 --new-tokens 32 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import redis

from bench.common import model_or_built
from tokenfleet.producer import Client
from tokenfleet.protocol import Keys
from tokenfleet.transport.server.embedded import EmbeddedRedis

WORDS = ["queue", "stream", "token", "fleet", "batch", "cache", "block", "worker", "redis", "slot"]
TIMES = re.compile(
    r"stopped after (\d+) requests \(([\d.]+)s reading/waiting for work, ([\d.]+)s in model steps, "
    r"([\d.]+)s in other Redis round trips\)"
)


def total_calls(client: redis.Redis) -> int:
    return sum(v["calls"] for k, v in client.info("commandstats").items() if k.startswith("cmdstat_"))


def run_fleet(n: int, args, url: str, model: str, prompts: list[str]) -> dict:
    prefix = f"bench-{n}w-{os.getpid()}"
    env = {**os.environ, "REDIS_URL": url, "TOKENFLEET_PREFIX": prefix, "OMP_NUM_THREADS": str(args.threads)}
    logs = [tempfile.TemporaryFile("w+") for _ in range(n)]  # noqa: SIM115 (read after the run)
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenfleet",
                "worker",
                "--model",
                model,
                "--name",
                f"w{i}",
                "--threads",
                str(args.threads),
                "--dtype",
                args.dtype,
                "--max-batch-size",
                str(args.max_batch_size),
                "--max-wait-ms",
                str(args.max_wait_ms),
                "--buckets",
                "32,64",
                "--max-seq-len",
                "512",
            ],
            env=env,
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(n)
    ]
    admin = redis.Redis.from_url(url)
    try:
        while admin.hlen(Keys(prefix).workers) < n:
            if any(w.poll() is not None for w in workers):
                raise RuntimeError("a worker exited during start-up")
            time.sleep(0.1)
        client = Client(url, model=model, prefix=prefix)
        calls_before = total_calls(admin)
        start = time.perf_counter()
        handles = [client.submit(p, max_new_tokens=args.new_tokens, ignore_eos=True) for p in prompts]
        results = [h.result(timeout=1800) for h in handles]
        wall = time.perf_counter() - start
        calls = total_calls(admin) - calls_before
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(120)
    intake = step = other = 0.0
    for log in logs:
        log.seek(0)
        match = TIMES.search(log.read())
        if match:
            intake += float(match[2])
            step += float(match[3])
            other += float(match[4])
    tokens = sum(len(r.token_ids) for r in results)
    worker_time = intake + step + other
    return {
        "workers": n,
        "threads_per_worker": args.threads,
        "requests": len(prompts),
        "generated_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "share_waiting_on_redis": round(intake / worker_time, 3) if worker_time else None,
        "share_model_steps": round(step / worker_time, 3) if worker_time else None,
        "share_other_redis": round(other / worker_time, 3) if worker_time else None,
        "redis_commands": calls,
        "redis_commands_per_token": round(calls / tokens, 3),
        "served_per_worker": {
            w: sum(r.worker == w for r in results) for w in sorted({r.worker for r in results})
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build the tiny model in a temp dir)")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-wait-ms", type=float, default=10)
    args = p.parse_args()

    model = model_or_built(args.model)
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))) for _ in range(args.requests)]
    rows = []
    with EmbeddedRedis() as server:
        for n in [int(x) for x in args.workers.split(",")]:
            row = run_fleet(n, args, server.url, model, prompts)
            print(json.dumps(row), flush=True)
            rows.append(row)
    base = rows[0]["tokens_per_s"]
    print(
        json.dumps(
            {
                "summary": "throughput_vs_first",
                **{f"{r['workers']}w": round(r["tokens_per_s"] / base, 3) for r in rows},
            }
        )
    )


if __name__ == "__main__":
    main()
