"""Paged KV cache benchmark: memory against a contiguous cache, continuous against dynamic batching.

Runs one mixed-length workload (prompt and output lengths drawn from a seeded RNG) through the
engine and scheduler in-process, once per mode, side by side in one run, and prints one JSON
line per mode plus a summary line with the ratios. Never run as a test.

    python -m bench.paged_kv                       # builds the tiny model in a temp dir
    python -m bench.paged_kv --model DIR --requests 64 --max-batch-size 16
"""

from __future__ import annotations

import argparse
import json
import random
import time

from bench.common import model_or_built
from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig
from tokenfleet.core.interface import StepOutput
from tokenfleet.core.offline import finished_in, run_offline
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.core import NativeCore
from tokenfleet.engines.native.runner import ModelRunner
from tokenfleet.protocol import Request


def workload(n: int, seed: int, max_prompt: int, max_new: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [0] + [rng.randrange(3, vocab) for _ in range(rng.randint(4, max_prompt - 1))],
            rng.randint(8, max_new),
        )
        for _ in range(n)
    ]


def run_mode(runner: ModelRunner, mode: str, jobs, args) -> dict:
    cfg = DynamicBatchingConfig(
        max_wait_ms=0,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        buckets=(args.max_prompt,),
        mode=mode,
    )
    sched = NativeCore(runner, cfg)
    steps, peak_blocks, peak_tokens = 0, 0, 0

    def watch(output: StepOutput) -> None:  # the pool at its fullest, after each forward pass
        nonlocal steps, peak_blocks, peak_tokens
        steps += len(output.batches)
        if sched.scheduler.allocator.num_used_blocks > peak_blocks:
            peak_blocks, peak_tokens = (
                sched.scheduler.allocator.num_used_blocks,
                sched.scheduler.allocator.num_tokens_stored,
            )

    seqs, arrivals = [], []
    for i, (ids, new) in enumerate(jobs):
        req = Request(id=f"{mode}-{i}", input_ids=tuple(ids), max_new_tokens=new, ignore_eos=True)
        seq = SeqState(
            key=req.id,
            request=req,
            prompt_ids=ids,
            tokenizer=runner.tokenizer,
            eos_ids=runner.eos_token_ids,
            enqueued_wall=time.time(),
        )
        arrivals.append((0.0, seq))
        seqs.append(seq)
    wall = finished_in(run_offline(sched, arrivals, on_step=watch))
    generated = sum(len(s.generated) for s in seqs)
    sched.check_idle()
    capacity = sched.capacity()
    contiguous_max = capacity.contiguous_bytes(args.max_batch_size, args.max_seq_len)
    longest = max(len(ids) + new for ids, new in jobs)
    contiguous_workload = capacity.contiguous_bytes(args.max_batch_size, longest)
    paged = peak_blocks * runner.bytes_per_block
    return {
        "mode": mode,
        "requests": len(jobs),
        "generated_tokens": generated,
        "steps": steps,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(generated / wall, 1),
        "preemptions": sched.scheduler.preemptions,
        "kv_peak_blocks": peak_blocks,
        "kv_peak_tokens_stored": peak_tokens,
        "kv_peak_slots_allocated": peak_blocks * runner.block_size,
        "kv_paged_peak_bytes": paged,
        "kv_contiguous_max_seq_len_bytes": contiguous_max,
        "kv_contiguous_longest_request_bytes": contiguous_workload,
        "paged_vs_contiguous_max": round(paged / contiguous_max, 3),
        "paged_vs_contiguous_longest": round(paged / contiguous_workload, 3),
        "mean_decode_batch": round(sum(s.mean_batch_size for s in seqs) / len(seqs), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build the tiny model in a temp dir)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="dynamic,continuous")
    args = p.parse_args()

    model = model_or_built(args.model)
    runner = ModelRunner(
        EngineConfig(model=model, device="cpu", dtype=args.dtype),
        KVCacheConfig(block_size=args.block_size, num_blocks=4096),
        DynamicBatchingConfig(),
    )
    jobs = workload(args.requests, args.seed, args.max_prompt, args.max_new, runner.vocab_size)
    run_mode(runner, "dynamic", jobs[:4], args)  # warm-up: first-call allocations, thread pools
    rows = [run_mode(runner, mode, jobs, args) for mode in args.modes.split(",")]
    for row in rows:
        print(json.dumps(row))
    by_mode = {row["mode"]: row for row in rows}
    if {"dynamic", "continuous"} <= by_mode.keys():
        print(
            json.dumps(
                {
                    "summary": "continuous_vs_dynamic",
                    "throughput_ratio": round(
                        by_mode["continuous"]["tokens_per_s"] / by_mode["dynamic"]["tokens_per_s"], 3
                    ),
                    "paged_peak_vs_contiguous_max": by_mode["continuous"]["paged_vs_contiguous_max"],
                    "paged_peak_vs_contiguous_longest": by_mode["continuous"]["paged_vs_contiguous_longest"],
                }
            )
        )


if __name__ == "__main__":
    main()
