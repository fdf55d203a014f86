"""What rounding prefill token counts to few sizes does: one engine in this process serves the same
mixed-length requests with the rounding on and off, taking turns (alternating which goes first,
so a slow spell of a shared host hits both).

Each round draws a new workload (``--requests`` prompts of 16 to 2 x ``--prompt-len`` tokens,
16 to 2 x ``--new-tokens`` new, all at once, ``--max-batch-size`` at a time, the rest joining as
others finish): prompt mixes never seen before, as a serving worker meets them. Prints a JSON
line per run and a Markdown table: medians, and the median of the within-round ratios. Never
run as a test.

    python -m bench.prefill_sizes --size tiny --dtype bfloat16 --compile --rounds 8
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench.common import model_or_built
from bench.prefill_budget import serve_burst
from bench.rows_tokenfleet import pool_blocks
from bench.workload import make_workload
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.models import SIZES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build --size in a temp dir)")
    p.add_argument("--size", default="tiny", choices=list(SIZES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=DynamicBatchingConfig().max_prefill_tokens)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()

    from tokenfleet.config import EngineConfig, KVCacheConfig
    from tokenfleet.engines.native.runner import ModelRunner

    model_dir = model_or_built(args.model, args.size)

    def workload(seed: int):
        return make_workload("mixed", args.requests, args.prompt_len, args.new_tokens, 0.0, seed)

    workloads = [workload(1000 + seed) for seed in range(args.rounds)]
    kv = KVCacheConfig(num_blocks=pool_blocks([r for reqs in workloads for r in reqs], args.max_batch_size))
    runner = ModelRunner(
        EngineConfig(model=model_dir, dtype=args.dtype, compile=args.compile),
        kv,
        DynamicBatchingConfig(max_batch_size=args.max_batch_size),
    )
    runner.warm_up()
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for seed, reqs in enumerate(workloads):
        for rounded in (True, False) if seed % 2 else (False, True):
            runner.pad_prefill = rounded
            run = serve_burst(runner, reqs, args.max_prefill_tokens, args.max_batch_size)
            run = {"rounded_sizes": rounded, "round": seed, **run}
            runs[rounded].append(run)
            print(json.dumps(run), flush=True)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[True], runs[False])]
    print(
        f"\n{args.requests} requests of mixed lengths at once, {args.max_batch_size} at a time; "
        f"{args.size}, {args.dtype}{', --compile' if args.compile else ''}; medians of {args.rounds} rounds\n"
    )
    print("| prefill sizes | tokens/s | TTFT mean ms | last TTFT ms | tokens/s by round |")
    print("|---|---|---|---|---|")
    for rounded in (True, False):
        med = {
            k: round(statistics.median(r[k] for r in runs[rounded]), 1)
            for k in ("tokens_per_s", "ttft_mean_ms")
        }
        last = round(statistics.median(r["ttft_last_ms"] for r in runs[rounded]), 1)
        by_round = " / ".join(str(r["tokens_per_s"]) for r in runs[rounded])
        name = "rounded (16 per doubling)" if rounded else "exact"
        print(f"| {name} | {med['tokens_per_s']} | {med['ttft_mean_ms']} | {last} | {by_round} |")
    print(f"\nrounded / exact tokens/s, median of the within-round ratios: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
