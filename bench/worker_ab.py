"""Two worker configurations side by side: both workers up on one Redis, bursts of requests taking
turns between them, so a shared host's drift (its speed moved 1.5x within minutes on our 2-vCPU
machines) hits both sides of every ratio.

Each side is a set of environment variables for its worker process (OpenMP spinning, thread
counts, allocators) and extra ``tokenfleet worker`` flags. Each round sends the same burst (the
fixed workload: ``--requests`` prompts at once, streamed token by token through one asyncio
client) to A and to B, the order alternating; prints a JSON line per round and a summary (median
tokens/s, the median of the within-round ratios B/A, and in how many rounds B was ahead). Never
run as a test.

    python -m bench.worker_ab --size tiny --a-env GOMP_SPINCOUNT=300000 --b-env GOMP_SPINCOUNT=10000

Two versions of the code, each worker on the README's flags alone (``--defaults``): A runs the
checkout at PATH, B this one.

    python -m bench.worker_ab --model DIR --defaults --a-env PYTHONPATH=PATH
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
from contextlib import ExitStack

from bench.common import allocator_env, code_commit, host_kind, model_or_built, worker_process
from bench.rows_tokenfleet import drive_clients, pool_blocks
from bench.workload import make_workload
from tokenfleet.models import SIZES


def parse_env(text: str) -> dict[str, str]:
    """``NAME=value,NAME=value`` (empty: no variables)."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"expected NAME=value[,NAME=value...], got {text!r}")
    return dict(pairs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build --size in a temp dir)")
    p.add_argument("--size", default="tiny", choices=list(SIZES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--a-env", default="", help="worker A's environment: NAME=value,...")
    p.add_argument("--b-env", default="", help="worker B's environment: NAME=value,...")
    p.add_argument("--a-flags", default="", help="extra `tokenfleet worker` flags for A")
    p.add_argument("--b-flags", default="", help="extra `tokenfleet worker` flags for B")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--no-compile", action="store_true", help="eager workers (compiled by default)")
    p.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="new random prompts every round (the same for A and B): no worker has seen them, so a "
        "prefix cache finds nothing (by default every round repeats the first round's burst)",
    )
    p.add_argument(
        "--defaults",
        action="store_true",
        help="workers on the README's flags alone (--dtype): no tuned flags, no preloaded allocator",
    )
    args = p.parse_args()

    from tokenfleet.producer import AsyncClient
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    model_dir = model_or_built(args.model, args.size)
    reqs = make_workload("fixed", args.requests, args.prompt_len, args.new_tokens, 1.0, 0)
    longest = args.prompt_len + args.new_tokens
    flags = ["--dtype", args.dtype, "--mode", "continuous", "--max-wait-ms", "5"]
    flags += [
        "--max-batch-size",
        str(args.requests),
        "--buckets",
        str(longest),
        "--max-seq-len",
        str(2 * longest),
    ]
    flags += ["--num-blocks", str(pool_blocks(reqs, args.requests))]
    flags += ["--no-compile" if args.no_compile else "--compile"]
    base_env = allocator_env()
    if args.defaults:
        flags, base_env = ["--dtype", args.dtype], {}
    sides = [
        ("A", parse_env(args.a_env), shlex.split(args.a_flags)),
        ("B", parse_env(args.b_env), shlex.split(args.b_flags)),
    ]
    speeds: dict[str, list[float]] = {"A": [], "B": []}
    with EmbeddedRedis() as server, ExitStack() as workers:
        prefixes = {}
        for name, env, extra in sides:  # both up (and compiled) before the first burst
            prefixes[name] = f"worker-ab-{os.getpid()}-{name}"
            workers.enter_context(
                worker_process(server.url, prefixes[name], model_dir, flags + extra, {**base_env, **env})
            )
        for round_no in range(args.rounds):
            order = ("A", "B") if round_no % 2 == 0 else ("B", "A")
            burst = make_workload("fixed", args.requests, args.prompt_len, args.new_tokens, 1.0, round_no + 1)
            for name in order:
                traces, wall = asyncio.run(
                    drive_clients(
                        server.url,
                        model_dir,
                        prefixes[name],
                        burst if args.fresh_prompts else reqs,
                        AsyncClient,
                    )
                )
                speeds[name].append(sum(len(t.token_ids) for t in traces) / wall)
            a, b = speeds["A"][-1], speeds["B"][-1]
            print(
                json.dumps({"round": round_no, "A": round(a, 1), "B": round(b, 1), "B/A": round(b / a, 3)}),
                flush=True,
            )
    ratios = [b / a for a, b in zip(speeds["A"], speeds["B"])]
    summary = {
        "A": {
            "env": sides[0][1],
            "flags": sides[0][2],
            "tokens_per_s": round(statistics.median(speeds["A"]), 1),
        },
        "B": {
            "env": sides[1][1],
            "flags": sides[1][2],
            "tokens_per_s": round(statistics.median(speeds["B"]), 1),
        },
        "b_over_a": round(statistics.median(ratios), 3),
        "b_ahead": f"{sum(r > 1 for r in ratios)}/{len(ratios)}",
        "size": args.size if args.model is None else args.model,
        "dtype": args.dtype,
        "flags": flags,
        "host": host_kind(),
        "commit": code_commit(),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
