"""A worker sharing its machine: the fixed workload through the README's worker (``--model`` and
nothing else; the sync client, a thread per request, as bench.compare's
``tokenfleet-defaults-threads``) and through vLLM-CPU's best configuration (``vllm-best``),
each alone, beside a busy neighbour (one pure-Python loop: a core's worth of someone else's
work), and under a CPU quota of one core (a cgroup of its own, as a container limited with
``--cpus 1``; ``taskset`` to one core where cgroups cannot be written). Rounds take turns over
every condition and system; each condition's figure is the median round and its ratio to the
same system alone, taken within each round. Never run as a test.

    python -m bench.neighbour --model ~/.cache/tokenfleet/models/smollm2-bfloat16 --rounds 3
    python -m bench.neighbour --model DIR --variants default,passive=OMP_WAIT_POLICY=PASSIVE --no-vllm
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.common import code_commit, host_kind, worker_process
from bench.defaults_e2e import drive_threads
from bench.rows_tokenfleet import CpuCounters
from bench.rows_vllm import VLLM_VENV, run_vllm
from bench.workload import make_workload, max_seq_len_for, summarize

CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
BUSY = "while True:\n    pass\n"


@contextlib.contextmanager
def busy_neighbour() -> Iterator[None]:
    """One process spinning in pure Python for as long as the block runs."""
    neighbour = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(0.5)  # running before the first request
        yield
    finally:
        neighbour.kill()
        neighbour.wait()


@contextlib.contextmanager
def one_core_quota() -> Iterator[Callable[[], None]]:
    """A function that puts the calling process (a child about to exec) under a quota of one CPU:
    a cgroup v1 ``cpu`` group of its own where it can be made, else an affinity of one core."""
    group = CGROUP_V1 / f"tokenfleet-bench-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
    except OSError:
        yield lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        return

    def join() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    try:
        yield join
    finally:
        for pid in (group / "cgroup.procs").read_text().split():  # back to the root before removal
            with contextlib.suppress(OSError):
                (CGROUP_V1 / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            group.rmdir()


def run_tokenfleet(model: str, reqs, env: dict[str, str], preexec: Callable[[], None] | None) -> dict:
    """One burst through a worker on the README's flags (started for it, as users start one)."""
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    prefix = f"neighbour-{os.getpid()}"
    with (
        EmbeddedRedis() as server,
        worker_process(server.url, prefix, model, [], env, preexec=preexec) as worker,
    ):
        counters = CpuCounters(server.url, worker.pid)
        traces, wall = drive_threads(server.url, model, prefix, reqs, counters)
    return {**summarize("tokenfleet-defaults-threads", traces, wall), **counters.used}


def parse_variants(text: str) -> dict[str, dict[str, str]]:
    """``name=VAR=value:VAR=value,name2=...`` (``default``: the environment as it is)."""
    variants = {}
    for item in text.split(","):
        name, _, rest = item.partition("=")
        variants[name] = dict(pair.split("=", 1) for pair in rest.split(":") if pair)
    return variants


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF model dir")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="vLLM's dtype")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--conditions", default="alone,neighbour,quota")
    p.add_argument(
        "--variants", default="default", help="worker environments to compare (see parse_variants)"
    )
    p.add_argument("--no-vllm", action="store_true", help="tokenfleet's rows only")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()

    reqs = make_workload("fixed", args.requests, args.prompt_len, args.new_tokens, 0.0, 0)
    variants = parse_variants(args.variants)
    systems = [f"tokenfleet:{name}" for name in variants]
    if not args.no_vllm and VLLM_VENV.exists():
        systems.append("vllm-best")
    conditions = args.conditions.split(",")
    rows: list[dict] = []
    for round_ in range(args.rounds):
        for condition in conditions:
            for system in systems if round_ % 2 == 0 else systems[::-1]:
                with contextlib.ExitStack() as stack:
                    preexec = None
                    if condition == "neighbour":
                        stack.enter_context(busy_neighbour())
                    elif condition == "quota":
                        preexec = stack.enter_context(one_core_quota())
                    if system == "vllm-best":
                        cpus = 1 if condition == "quota" else None  # its best under one core: one thread
                        row = run_vllm(
                            args.model,
                            args.dtype,
                            reqs,
                            args.requests,
                            max_seq_len_for(reqs),
                            True,
                            preexec,
                            cpus,
                        )
                    else:
                        row = run_tokenfleet(args.model, reqs, variants[system.split(":", 1)[1]], preexec)
                row.pop("_token_ids", None)
                row.update(system=system, condition=condition, round=round_)
                rows.append(row)
                print(json.dumps(row), flush=True)
    report(rows, systems, conditions, args)


def report(rows: list[dict], systems: list[str], conditions: list[str], args: argparse.Namespace) -> None:
    """Per system and condition: median tokens/s, and the median within-round ratio to alone."""

    def of(system: str, condition: str) -> list[dict]:
        return [r for r in rows if r["system"] == system and r["condition"] == condition]

    lines = [
        f"bench.neighbour, {host_kind()} ({platform.processor() or platform.machine()}), "
        f"{os.cpu_count()} CPUs, code {code_commit()}, {time.strftime('%Y-%m-%d')}, model {args.model}",
        "",
        "| system | condition | tokens/s by round | median | vs alone (median of rounds) | TTFT p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    summary = []
    for system in systems:
        alone = {r["round"]: r["tokens_per_s"] for r in of(system, "alone")}
        for condition in conditions:
            runs = of(system, condition)
            speeds = [r["tokens_per_s"] for r in runs]
            ratios = [r["tokens_per_s"] / alone[r["round"]] for r in runs if alone.get(r["round"])]
            ratio = statistics.median(ratios) if ratios else None
            ttft = statistics.median(r["ttft_p50_ms"] for r in runs)
            summary.append(
                {
                    "system": system,
                    "condition": condition,
                    "median": statistics.median(speeds),
                    "vs_alone": ratio,
                }
            )
            lines.append(
                f"| {system} | {condition} | {' / '.join(f'{s:.0f}' for s in speeds)} | "
                f"{statistics.median(speeds):.0f} | {'' if ratio is None else f'{ratio:.2f}x'} | {ttft:.0f} |"
            )
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"neighbour-{stamp}.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    (out / f"neighbour-{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
