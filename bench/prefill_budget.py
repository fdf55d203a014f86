"""What ``max_prefill_tokens`` does to a burst: TTFT and throughput of one engine in this process,
the budgets taking turns (round robin, so a slow spell of a shared host hits each of them).

A burst of ``--requests`` prompts arrives at an idle worker in continuous mode; with a budget
below the burst's prompt tokens it starts in parts, a decode step between them. Prints a JSON line
per run and a Markdown table of medians over ``--rounds``. Never run as a test.

    python -m bench.prefill_budget --size small --dtype bfloat16 --budgets 8192,2048,1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.common import host_kind, model_or_built
from bench.rows_tokenfleet import pool_blocks
from bench.workload import Req, make_workload
from tokenfleet.models import SIZES


def serve_burst(runner, reqs: list[Req], budget: int, max_batch_size: int) -> dict:
    from tokenfleet.config import DynamicBatchingConfig
    from tokenfleet.core.offline import finished_in, run_offline
    from tokenfleet.core.sequence import SeqState
    from tokenfleet.engines.native.core import NativeCore
    from tokenfleet.protocol import Request

    longest = max(len(r.prompt_ids) for r in reqs)
    batching = DynamicBatchingConfig(
        mode="continuous",
        max_wait_ms=0,
        max_batch_size=max_batch_size,
        max_seq_len=4 * longest,
        buckets=(2 * longest,),
        max_prefill_tokens=budget,
    )
    sched = NativeCore(runner, batching)
    seqs = []
    for i, r in enumerate(reqs):
        request = Request(
            id=f"r{i}", input_ids=tuple(r.prompt_ids), max_new_tokens=r.max_new_tokens, ignore_eos=True
        )
        seq = SeqState(i, request, list(r.prompt_ids), runner.tokenizer, runner.eos_token_ids, time.time())
        seqs.append((0.0, seq))
    first: dict[int, float] = {}
    start = time.perf_counter()

    def on_token(out) -> None:
        first.setdefault(out.seq.key, time.perf_counter() - start)

    wall = finished_in(run_offline(sched, seqs, on_token))
    tokens = sum(r.max_new_tokens for r in reqs)
    ttft = sorted(first.values())
    return {
        "budget": budget,
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_mean_ms": round(1000 * statistics.mean(ttft), 1),
        "ttft_first_ms": round(1000 * ttft[0], 1),
        "ttft_last_ms": round(1000 * ttft[-1], 1),
        "wall_s": round(wall, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build --size in a temp dir)")
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budgets", default="8192,2048,1024", help="max_prefill_tokens values, comma-separated")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()

    from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig
    from tokenfleet.engines.native.runner import ModelRunner

    model_dir = model_or_built(args.model, args.size)
    reqs = make_workload("fixed", args.requests, args.prompt_len, args.new_tokens, 0.0, 0)
    kv = KVCacheConfig(num_blocks=pool_blocks(reqs, args.requests))
    runner = ModelRunner(
        EngineConfig(model=model_dir, dtype=args.dtype, compile=args.compile),
        kv,
        DynamicBatchingConfig(max_batch_size=args.requests),
    )
    runner.warm_up()
    budgets = [int(b) for b in args.budgets.split(",")]
    serve_burst(runner, reqs[:2], budgets[0], args.requests)  # warm-up
    runs: dict[int, list[dict]] = {b: [] for b in budgets}
    for _ in range(args.rounds):
        for budget in budgets:
            run = serve_burst(runner, reqs, budget, args.requests)
            runs[budget].append(run)
            print(json.dumps(run), flush=True)
    model = args.model or args.size
    print(
        f"\n{args.requests} x {args.prompt_len}-token prompts at once, {args.new_tokens} new each; "
        f"{model}, {args.dtype}{', --compile' if args.compile else ''}; medians of {args.rounds} rounds; "
        f"{host_kind()}\n"
    )
    print("| max_prefill_tokens | tokens/s | TTFT mean ms | first TTFT ms | last TTFT ms |")
    print("|---|---|---|---|---|")
    for budget in budgets:
        keys = [k for k in runs[budget][0] if k != "budget"]
        med = {k: round(statistics.median(r[k] for r in runs[budget]), 1) for k in keys}
        print(
            f"| {budget} | {med['tokens_per_s']} | {med['ttft_mean_ms']} | {med['ttft_first_ms']} | "
            f"{med['ttft_last_ms']} |"
        )


if __name__ == "__main__":
    main()
