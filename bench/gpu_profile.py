"""Where a decode step's time goes: kernels per step, host time, device-busy time and host syncs.

    python -m bench.gpu_profile --device cuda --size small --dtype bfloat16 --out bench/results/gpu

For each batch size (8, 16, 32) and each decode route the device has (eager; CUDA graphs where
captured), 20 decode steps of the runner plus their token choice are profiled with
torch.profiler: ``kernels_per_step`` (device kernels launched), ``host_us_per_step`` (wall time
of a step as the host sees it, the sync included, unprofiled), ``device_busy_us_per_step`` (the
union of the kernels' intervals), ``syncs_per_step`` (host waits on the device: stream/device/
event synchronizes and blocking copies), host-to-device and device-to-host copies per step, and
``uploads_per_step`` (the runner's one-copy metadata sends). Runs on the CPU too (no device
columns), which is how it is tested. Prints one JSON line per row and writes them all to
``--out``/gpu_profile.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.common import host_kind
from tokenfleet.models import SIZES

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")
STEPS = 20
CONTEXT = 160  # tokens each sequence holds: a 128-token prompt and 32 generated


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def profile_steps(runner, batch: int) -> dict:  # noqa: ANN001 (a ModelRunner)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tokenfleet.engines.native.sampling.draw import choose_tokens

    blocks = -(-CONTEXT // runner.block_size)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
    rows = [type("Greedy", (), {"temperature": 0.0})() for _ in range(batch)]

    def step() -> None:
        logits = runner.decode(tables, [CONTEXT] * batch, [runner.pad_token_id] * batch)
        choose_tokens(logits, rows)  # greedy: the step's one device-to-host copy

    for _ in range(3):
        step()
    start = time.perf_counter()  # unprofiled: the profiler's own overhead is not the step's
    for _ in range(STEPS):
        step()
    host_us = (time.perf_counter() - start) / STEPS * 1e6
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(STEPS):
            step()
    events = prof.events()
    on_device = [e for e in events if e.device_type.name == "CUDA"]
    kernels = [e for e in on_device if not e.name.startswith("Memcpy")]
    syncs = [e for e in events if any(e.name.startswith(s.strip()) for s in SYNC_CALLS)]
    return {
        "batch": batch,
        "host_us_per_step": round(host_us, 1),
        "kernels_per_step": round(len(kernels) / STEPS, 1),
        "device_busy_us_per_step": round(
            busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) / STEPS, 1
        ),
        "syncs_per_step": round(len(syncs) / STEPS, 2),
        "h2d_copies_per_step": round(sum("HtoD" in e.name for e in on_device) / STEPS, 2),
        "d2h_copies_per_step": round(sum("DtoH" in e.name for e in on_device) / STEPS, 2),
        "uploads_per_step": None,
        "graph_replays": 0 if runner.graphs is None else runner.graphs.replays,
        "device": str(runner.device),
        "torch": torch.__version__,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build --size in a temp dir)")
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="8,16,32")
    p.add_argument("--out", default="bench/results/gpu")
    args = p.parse_args()

    from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig
    from tokenfleet.engines.native.runner import ModelRunner
    from tokenfleet.models.random_init import init_model

    model = args.model or str(init_model(Path(tempfile.mkdtemp()) / "model", args.size))
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * (-(-CONTEXT // 16)) + 8
    results = []
    for graphs in (False, True):
        runner = ModelRunner(
            EngineConfig(model=model, device=args.device, dtype=args.dtype, cuda_graphs=graphs),
            KVCacheConfig(num_blocks=blocks),
            DynamicBatchingConfig(
                max_batch_size=max(batches), max_seq_len=CONTEXT + 64, buckets=(CONTEXT + 64,)
            ),
        )
        if graphs and runner.graphs is None:
            continue  # no CUDA graphs on this device
        runner.warm_up()
        for batch in batches:
            before = runner.upload.copies
            row = profile_steps(runner, batch)
            row["uploads_per_step"] = round((runner.upload.copies - before) / (2 * STEPS + 3), 2)
            row.update(route="cuda-graphs" if graphs else "eager", host=host_kind(), size=args.size)
            print(json.dumps(row), flush=True)
            results.append(row)
        del runner
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_profile.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
