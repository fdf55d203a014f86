"""Do adapter loads stall the steps beside them? Eight requests on the base model decode while
requests naming other adapters arrive one every ``--every`` steps, more adapters than slots
(``--adapters`` over ``--max-loras``, rank ``--rank`` on every linear, made here by peft with
random weights), so that loads and evictions go on beside the decoding rows; then the same eight
with no adapter requests. Rounds take turns. Decode steps of the eight alone are timed and filed
by whether a load was in flight. The native engine with the worker's defaults for this host.
Never run as a test.

    python -m bench.lora_loading --model ~/.cache/tokenfleet/models/smollm2-bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import code_commit, host_kind
from bench.lora import make_adapters

ROWS = 8  # base requests decoding throughout


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict:
    return {
        "steps": len(values),
        "p50_ms": round(statistics.median(values) * 1000, 1),
        "p99_ms": round(percentile(values, 0.99) * 1000, 1),
        "max_ms": round(max(values) * 1000, 1),
    }


class Bench:
    def __init__(self, model: str, adapters: dict[str, str], slots: int, new_tokens: int):
        from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig, WorkerConfig
        from tokenfleet.engines import build_core

        batching = DynamicBatchingConfig(
            mode="continuous", max_wait_ms=0, max_batch_size=2 * ROWS, max_seq_len=512, buckets=(128,)
        )
        config = WorkerConfig(EngineConfig(model=model, max_loras=slots), batching, KVCacheConfig())
        self.core = build_core(config)
        self.runner = self.core.runner  # type: ignore[attr-defined]
        self.adapters, self.new_tokens, self.made = adapters, new_tokens, 0

    def seq(self, adapter: str | None, new_tokens: int):
        from tokenfleet.core.sequence import SeqState
        from tokenfleet.protocol import Request

        self.made += 1
        ids = [3 + (self.made * 7 + j) % 5000 for j in range(64)]
        request = Request(
            id=f"r{self.made}",
            input_ids=tuple(ids),
            max_new_tokens=new_tokens,
            ignore_eos=True,
            adapter=adapter,
        )
        path = self.adapters[adapter] if adapter else None
        runner = self.runner
        return SeqState(
            request.id, request, ids, runner.tokenizer, runner.eos_token_ids, time.time(), adapter_path=path
        )

    def phase(self, every: int, times: dict[bool, list[float]], waits: list[float]) -> None:
        """``ROWS`` base rows to their end; ``every`` > 0: an adapter request every that many steps."""
        rows = [self.seq(None, self.new_tokens) for _ in range(ROWS)]
        for seq in rows:
            assert self.core.add(seq, time.monotonic()) is None
        names, steps, extras = list(self.adapters), 0, []
        while not all(s.finished for s in rows):
            if every and steps % every == every - 1:
                extra = self.seq(names[(self.made // every) % len(names)], 1)
                assert self.core.add(extra, time.monotonic()) is None
                extras.append((extra, time.perf_counter()))
            loading = self.runner.lora.reading > 0
            begin = time.perf_counter()
            refused = self.core.open_parked()  # as the worker does before each step
            out = self.core.step()
            seconds = time.perf_counter() - begin
            if out.failed or refused:
                raise SystemExit(f"requests failed: {out.failed or refused}")
            steps += 1
            waits += [time.perf_counter() - t for s, t in extras if s.finished]
            extras = [(s, t) for s, t in extras if not s.finished]
            if [(b.kind, b.size) for b in out.batches] == [("decode", ROWS)]:  # the eight alone
                times[loading].append(seconds)
        while self.core.has_work:  # adapter requests still held: finish them
            self.core.open_parked()
            self.core.step()
            waits += [time.perf_counter() - t for s, t in extras if s.finished]
            extras = [(s, t) for s, t in extras if not s.finished]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--adapters", type=int, default=12)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--every", type=int, default=6, help="steps between adapter requests")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--adapters-dir", help="make the adapters here, or reuse those an earlier run made")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.adapters_dir or tmp) / f"rank{args.rank}"
        adapters = make_adapters(args.model, args.adapters, args.rank, root)
        bench = Bench(args.model, adapters, args.max_loras, args.new_tokens)
        churn: dict[bool, list[float]] = {True: [], False: []}
        quiet: dict[bool, list[float]] = {True: [], False: []}
        waits: list[float] = []
        bench.phase(0, quiet, waits)  # warm-up
        quiet[False].clear()
        for round_ in range(args.rounds):
            for every in (args.every, 0) if round_ % 2 == 0 else (0, args.every):
                bench.phase(every, churn if every else quiet, waits)
    result = {
        "load_in_flight": summary(churn[True]),
        "churn_no_load": summary(churn[False]) if churn[False] else None,
        "no_adapters": summary(quiet[False]),
        "adapter_request_latency": summary(waits),  # its load (when cold), prefill and one token
    }
    print(json.dumps(result))
    print(
        f"bench.lora_loading, {host_kind()} ({platform.processor() or platform.machine()}), "
        f"{os.cpu_count()} CPUs, code {code_commit()}, {time.strftime('%Y-%m-%d')}, model {args.model}: "
        f"{ROWS} base rows decoding; an adapter request every {args.every} steps, {args.adapters} "
        f"adapters of rank {args.rank} over {args.max_loras} slots; {args.rounds} rounds"
    )
    print(f"| decode steps of the {ROWS} | steps | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|")
    for label, key in (
        ("an adapter load in flight", "load_in_flight"),
        ("no load, adapter requests around", "churn_no_load"),
        ("no adapter requests at all", "no_adapters"),
    ):
        row = result[key]
        if row:
            print(f"| {label} | {row['steps']} | {row['p50_ms']} | {row['p99_ms']} | {row['max_ms']} |")
    print(f"an adapter request, its load included, to its one token: {result['adapter_request_latency']}")
    ratio = result["load_in_flight"]["p99_ms"] / result["no_adapters"]["p99_ms"]
    print(f"p99 with a load in flight / with none: {ratio:.2f}x")


if __name__ == "__main__":
    main()
