"""The seed's table: batching mode and max_wait_ms against throughput and time to first token.

End to end through Redis: for each configuration a worker process on its own Redis, 32
concurrent clients (each submits, waits for its result, submits again), the same prompts and
lengths; throughput (generated tokens / wall time) and client-side TTFT p50/p99. Prints JSON
lines and a Markdown table, and draws the throughput vs TTFT trade-off over max_wait_ms to a
PNG (matplotlib: pip install matplotlib). Never run as a test.

    python -m bench.max_wait --plot docs/max_wait.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from bench.common import model_or_built, percentile, worker_process
from tokenfleet.producer import AsyncClient
from tokenfleet.transport.server.embedded import EmbeddedRedis

CONFIGS = [
    ("static batch 1", ["--mode", "static", "--max-batch-size", "1"]),
    ("static batch 8", ["--mode", "static", "--max-batch-size", "8"]),
    ("dynamic 10 ms", ["--mode", "dynamic", "--max-wait-ms", "10"]),
    ("dynamic 50 ms", ["--mode", "dynamic", "--max-wait-ms", "50"]),
    ("dynamic 200 ms", ["--mode", "dynamic", "--max-wait-ms", "200"]),
    ("continuous 50 ms", ["--mode", "continuous", "--max-wait-ms", "50"]),
]
WORDS = ["queue", "stream", "token", "fleet", "batch", "cache", "block", "worker", "redis", "slot"]


async def drive(url: str, model: str, prefix: str, clients: int, per_client: int, new_tokens: int, seed: int):
    rng = random.Random(seed)
    prompts = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9))) for _ in range(clients * per_client)
    ]
    ttfts: list[float] = []
    tokens = 0

    async def one_client(c: int) -> None:
        nonlocal tokens
        async with AsyncClient(url, model=model, prefix=prefix) as client:
            for k in range(per_client):
                start = time.perf_counter()
                handle = await client.submit(
                    prompts[c * per_client + k], max_new_tokens=new_tokens, ignore_eos=True
                )
                first = None
                async for chunk in handle.stream(timeout=600):
                    first = first or time.perf_counter()
                    tokens += len(chunk.token_ids)
                ttfts.append((first - start) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(one_client(c) for c in range(clients)))
    return tokens, time.perf_counter() - start, ttfts


def run_config(label: str, flags: list[str], args, url: str, model: str) -> dict:
    prefix = f"maxwait-{abs(hash(label)) % 10**8}"
    worker_flags = ["--dtype", args.dtype, "--buckets", "64", "--max-seq-len", "512"]
    worker_flags += ["--max-batch-size", "32"] if "--max-batch-size" not in flags else []
    with worker_process(url, prefix, model, worker_flags + flags):
        tokens, wall, ttfts = asyncio.run(
            drive(url, model, prefix, args.clients, args.per_client, args.new_tokens, args.seed)
        )
    return {
        "config": label,
        "max_wait_ms": float(flags[flags.index("--max-wait-ms") + 1]) if "--max-wait-ms" in flags else None,
        "clients": args.clients,
        "requests": args.clients * args.per_client,
        "generated_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(statistics.median(ttfts), 1),
        "ttft_p99_ms": round(percentile(ttfts, 99), 1),
    }


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    dynamic = [r for r in rows if r["config"].startswith("dynamic")]
    ax.plot([r["ttft_p50_ms"] for r in dynamic], [r["tokens_per_s"] for r in dynamic], "o-", label="dynamic")
    for i, r in enumerate(dynamic):  # alternate label sides: neighbouring points often overlap
        ax.annotate(
            f"max_wait {r['max_wait_ms']:g} ms",
            (r["ttft_p50_ms"], r["tokens_per_s"]),
            textcoords="offset points",
            xytext=(8, -14 if i % 2 == 0 else 8),
            fontsize=8,
        )
    for r in rows:
        if not r["config"].startswith("dynamic"):
            ax.plot(r["ttft_p50_ms"], r["tokens_per_s"], "s", label=r["config"])
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("time to first token, p50 (ms, log scale)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{rows[0]['clients']} concurrent clients: throughput vs TTFT")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build the tiny model in a temp dir)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--per-client", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="write the throughput/TTFT PNG here")
    p.add_argument("--replot", metavar="JSON", help="only redraw --plot from a previous run's .json")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot)
        return
    if args.clients < 8:  # static batch 8 dispatches only full batches: fewer clients never fill one
        raise SystemExit("--clients must be at least 8 (the static batch 8 row waits for 8 requests)")
    model = model_or_built(args.model)
    rows = []
    with EmbeddedRedis() as server:
        for label, flags in CONFIGS:
            rows.append(run_config(label, flags, args, server.url, model))
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["tokens_per_s"]
    print("\n| config | tokens/s | vs batch 1 | TTFT p50 ms | TTFT p99 ms |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['tokens_per_s']} | {r['tokens_per_s'] / base:.2f}x | {r['ttft_p50_ms']} "
            f"| {r['ttft_p99_ms']} |"
        )
    if args.plot:
        plot(rows, args.plot)
        with open(args.plot.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)
        print(f"\nplot: {args.plot} (data beside it, .json)")


if __name__ == "__main__":
    main()
