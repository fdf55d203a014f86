"""End to end through Redis against the same engine in process, bursts taking turns.

What the Redis path costs, measured so that a shared host's drift (1.5-3x within minutes on our
2-vCPU machines) hits both sides of every ratio: both are loaded, and compiled when asked, before
the first burst: tokenfleet's engine and scheduler in this process (``bench.compare``'s
``tokenfleet-engine`` row) and a ``tokenfleet worker`` process on its own Redis, fed by one
asyncio client that streams every request (the ``tokenfleet-e2e`` row). Each round sends the same
burst (the fixed workload: ``--requests`` prompts at once) to each, the order alternating. Both
run on tcmalloc where the machine has it (this process re-executes itself with it preloaded, as
the worker gets it), so the ratio weighs the Redis path and not the allocators.
Prints a JSON line per round and a summary: median tokens/s of each, the median of the
within-round ratios (end to end / in process), in how many rounds end to end came within 5%, and
the CPU seconds the client, Redis and the worker used per end-to-end burst. Never run as a test.

    python -m bench.e2e_overhead --size small --rounds 8
    python -m bench.e2e_overhead --size tiny --stream-interval-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys

from bench.common import allocator_env, model_or_built, pin_bf16_linear_route, worker_process
from bench.rows_tokenfleet import CpuCounters, InProcessEngine, drive_clients, worker_flags
from bench.workload import make_workload, max_seq_len_for, summarize
from tokenfleet.models import SIZES

WITHIN = 0.95  # "within 5%": end to end at least this share of in process


def main() -> None:
    from tokenfleet.config import DynamicBatchingConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build --size in a temp dir)")
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="the worker's")
    p.add_argument("--stream-interval-ms", type=float, default=0.0, help="the worker's")
    p.add_argument("--max-prefill-tokens", type=int, default=DynamicBatchingConfig().max_prefill_tokens)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--no-compile", action="store_true", help="eager on both sides (compiled by default)")
    p.add_argument(
        "--worker-flags", default="", help="extra `tokenfleet worker` flags, e.g. '--overlap-io off'"
    )
    args = p.parse_args()

    preload = allocator_env()
    if preload and os.environ.get("LD_PRELOAD") != preload["LD_PRELOAD"]:
        # the worker runs on tcmalloc (as the benchmarks give it): so does this process's engine,
        # or the ratio would weigh allocators as well as the Redis path
        os.execve(
            sys.executable,
            [sys.executable, "-m", "bench.e2e_overhead", *sys.argv[1:]],
            {**os.environ, **preload},
        )

    from tokenfleet.producer import AsyncClient
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    compile = not args.no_compile
    model_dir = model_or_built(args.model, args.size)
    route = pin_bf16_linear_route(args.dtype)  # both sides on the same linears
    reqs = make_workload("fixed", args.requests, args.prompt_len, args.new_tokens, 1.0, 0)
    max_seq_len = max_seq_len_for(reqs)
    flags = worker_flags(
        args.dtype,
        reqs,
        args.requests,
        max_seq_len,
        args.max_wait_ms,
        args.stream_interval_ms,
        compile,
        args.max_prefill_tokens,
    )
    flags += shlex.split(args.worker_flags)
    prefix = f"e2e-overhead-{os.getpid()}"
    speeds: dict[str, list[float]] = {"in_process": [], "e2e": []}
    rows: dict[str, list[dict]] = {"in_process": [], "e2e": []}
    cpu: list[dict[str, float]] = []
    with (
        EmbeddedRedis() as server,
        worker_process(server.url, prefix, model_dir, flags, allocator_env()) as worker,
    ):
        engine = InProcessEngine(
            model_dir,
            args.dtype,
            reqs,
            args.requests,
            max_seq_len,
            compile=compile,
            max_prefill_tokens=args.max_prefill_tokens,
        )
        counters = CpuCounters(server.url, worker.pid)
        for round_no in range(args.rounds):
            order = ("in_process", "e2e") if round_no % 2 == 0 else ("e2e", "in_process")
            for side in order:
                if side == "in_process":
                    traces, wall = engine.burst(reqs)
                else:
                    traces, wall = asyncio.run(
                        drive_clients(server.url, model_dir, prefix, reqs, AsyncClient, counters=counters)
                    )
                    cpu.append(counters.used)
                row = summarize(side, traces, wall)
                row.pop("_token_ids")
                rows[side].append(row)
                speeds[side].append(row["tokens_per_s"])
            ratio = speeds["e2e"][-1] / speeds["in_process"][-1]
            line = {
                "round": round_no,
                **{k: v[-1] for k, v in speeds.items()},
                "e2e/in_process": round(ratio, 3),
            }
            print(json.dumps(line), flush=True)
    ratios = [e / i for i, e in zip(speeds["in_process"], speeds["e2e"])]

    def median_of(side: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rows[side]), 2)

    summary = {
        "size": args.size if args.model is None else args.model,
        "dtype": args.dtype,
        "compile": compile,
        "stream_interval_ms": args.stream_interval_ms,
        "max_wait_ms": args.max_wait_ms,
        "worker_flags": args.worker_flags,
        "allocator": "tcmalloc, both sides" if preload else "the system's",
        "bf16_linear": route,
        "rounds": args.rounds,
        "in_process_tokens_per_s": median_of("in_process", "tokens_per_s"),
        "e2e_tokens_per_s": median_of("e2e", "tokens_per_s"),
        "e2e_over_in_process": round(statistics.median(ratios), 3),
        "rounds_within_5pct": f"{sum(r >= WITHIN for r in ratios)}/{len(ratios)}",
        "ttft_p50_ms": {side: median_of(side, "ttft_p50_ms") for side in rows},
        "itl_p50_ms": {side: median_of(side, "itl_p50_ms") for side in rows},
        "e2e_cpu_s": {k: round(statistics.median(c[k] for c in cpu), 3) for k in cpu[0]},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
