"""Time to first token of a request that arrives alone, against ``max_wait_ms`` + prefill + 5 ms.

For each ``max_wait_ms``: a worker process on its own Redis, then ``--repeats`` requests one at a
time (each after the previous finished and a pause, so the worker is idle when it arrives),
TTFT measured by the client from just before ``submit`` to the first token. The prefill time of
the same prompt is measured in this process on the same model and dtype, taking turns with the
requests: before each request, after the same idle pause (a CPU that sat idle runs its next
forward slower), and each setting's bound uses the median of its own turns. Measured once up
front, minutes before the requests, it had moved by 10% between two runs on a shared 2-vCPU
host, as much as the 5 ms margin many times over. The warm, back-to-back figure is printed
beside it. Prints JSON lines and a Markdown table. Never run as a test.

    python -m bench.lone_ttft --size small --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench.common import (
    allocator_env,
    model_or_built,
    percentile,
    pin_bf16_linear_route,
    pinned_bf16_linear,
    worker_process,
)
from bench.workload import make_workload
from tokenfleet.models import SIZES
from tokenfleet.producer import Client
from tokenfleet.transport.server.embedded import EmbeddedRedis

IDLE_S = 0.3


class InProcessPrefill:
    """The prompt's prefill on this process's own engine (same model and dtype as the worker's),
    timed with the host sync that sampling needs."""

    def __init__(self, model_dir: str, dtype: str, prompt: list[int]):
        from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig
        from tokenfleet.engines.native.runner import ModelRunner

        self.runner = ModelRunner(
            EngineConfig(model=model_dir, dtype=dtype, bf16_linear=pinned_bf16_linear()),
            KVCacheConfig(num_blocks=64),
            DynamicBatchingConfig(),
        )
        self.prompt = prompt
        self.ms()  # the first includes one-time set-up

    def ms(self) -> float:
        runner = self.runner
        blocks = -(-len(self.prompt) // runner.block_size)  # nothing else runs: blocks 0.. are free
        start = time.perf_counter()
        runner.prefill([list(range(blocks))], [self.prompt]).logits.argmax(-1).tolist()
        return (time.perf_counter() - start) * 1000

    def warm_ms(self, repeats: int) -> float:
        """Median of back-to-back prefills."""
        return statistics.median(self.ms() for _ in range(repeats))


def lone_ttfts(
    url: str, model_dir: str, dtype: str, wait_ms: float, prefill: InProcessPrefill, repeats: int
) -> tuple[list[float], list[float]]:
    """TTFTs of ``repeats`` lone requests, and the in-process prefill times taken in turn with them."""
    prefix = f"lone-{os.getpid()}-{wait_ms:g}"
    flags = ["--dtype", dtype, "--buckets", "512", "--max-seq-len", "1024", "--max-wait-ms", str(wait_ms)]
    prompt = prefill.prompt
    with worker_process(url, prefix, model_dir, flags, allocator_env()):
        client = Client(url, model=model_dir, prefix=prefix)
        client.submit(input_ids=prompt, max_new_tokens=2).result(timeout=300)  # warm-up
        ttfts, prefills = [], []
        for _ in range(repeats):
            time.sleep(IDLE_S)  # both idle before each: the engine here, then the worker
            prefills.append(prefill.ms())
            time.sleep(IDLE_S)  # the worker is idle, blocked on its read, when the request arrives
            start = time.perf_counter()
            handle = client.submit(input_ids=prompt, max_new_tokens=4, ignore_eos=True)
            next(iter(handle.stream(timeout=300)))
            ttfts.append((time.perf_counter() - start) * 1000)
            handle.result(timeout=300)
        return ttfts, prefills


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build --size in a temp dir)")
    p.add_argument("--size", default="tiny", choices=list(SIZES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-wait-ms", default="0,10,50", help="comma-separated values to try")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    model_dir = model_or_built(args.model, args.size)
    prompt = make_workload("fixed", 1, args.prompt_len, 4, 1.0, 0)[0].prompt_ids
    route = pin_bf16_linear_route(args.dtype)  # the bound's prefill and the workers on one route
    in_process = InProcessPrefill(model_dir, args.dtype, prompt)
    prefill_warm = in_process.warm_ms(args.repeats)
    rows = []
    with EmbeddedRedis() as server:
        for wait in (float(w) for w in args.max_wait_ms.split(",")):
            ttfts, prefills = lone_ttfts(server.url, model_dir, args.dtype, wait, in_process, args.repeats)
            prefill = statistics.median(prefills)
            bound = wait + prefill + 5
            row = {
                "max_wait_ms": wait,
                "prefill_ms": round(prefill, 2),
                "prefill_warm_ms": round(prefill_warm, 2),
                "bound_ms": round(bound, 2),
                "ttft_p50_ms": round(statistics.median(ttfts), 2),
                "ttft_max_ms": round(max(ttfts), 2),
                "ttft_p90_ms": round(percentile(ttfts, 90), 2),
                "within_bound": sum(t <= bound for t in ttfts),
                "repeats": len(ttfts),
                "bf16_linear": route,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        "\n| max_wait_ms | prefill ms (idle / warm) | bound ms | TTFT p50 ms | TTFT max ms | within bound |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        prefill_cell = f"{r['prefill_ms']} / {r['prefill_warm_ms']}"
        cells = [f"{r['max_wait_ms']:g}", prefill_cell, r["bound_ms"], r["ttft_p50_ms"], r["ttft_max_ms"]]
        print("| " + " | ".join(map(str, cells)) + f" | {r['within_bound']}/{r['repeats']} |")


if __name__ == "__main__":
    main()
