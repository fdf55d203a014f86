"""Many fine-tunes on one base: the fixed workload (32 x 128-token prompts, 64 new tokens each)
with every request naming one of ``--adapters`` LoRA adapters of rank ``--rank`` on every linear
(made here by peft, random weights), against the same requests on the base model alone, through
the README's worker (``--model`` and ``--lora NAME=DIR`` for each) and through vLLM-CPU's offline
engine in its best configuration with the same adapters as ``LoRARequest``s, rounds taking turns.
Never run as a test.

    python -m bench.lora --model ~/.cache/tokenfleet/models/smollm2-bfloat16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import code_commit, host_kind, worker_process
from bench.defaults_e2e import drive_threads
from bench.rows_tokenfleet import CpuCounters
from bench.rows_vllm import VLLM_VENV, vllm_best_env
from bench.workload import Trace, make_workload, max_seq_len_for, summarize

HERE = Path(__file__).resolve().parent
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: str, count: int, rank: int, root: Path) -> dict[str, str]:
    """``count`` PEFT adapters of ``model``, rank ``rank`` on every linear, random weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i in range(count):
        out[f"lora{i}"] = str(root / f"lora{i}")
        if (root / f"lora{i}" / "adapter_model.safetensors").exists():
            continue  # made by an earlier run (--adapters-dir)
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        peft_model = get_peft_model(base, config)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0.0, 0.02)
        peft_model.save_pretrained(out[f"lora{i}"])
    return out


def run_tokenfleet(model: str, reqs, adapters: dict[str, str], use: list[str | None]) -> dict:
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    prefix = f"lora-{os.getpid()}"
    flags = [flag for name, path in adapters.items() for flag in ("--lora", f"{name}={path}")]
    if adapters:  # a slot for each: the workload keeps all of them busy at once
        flags += ["--max-loras", str(len(adapters))]
    log = os.environ.get("BENCH_WORKER_LOG")
    with EmbeddedRedis() as server, worker_process(server.url, prefix, model, flags) as worker:
        counters = CpuCounters(server.url, worker.pid)
        if adapters:  # every adapter resident before the clock starts, as vLLM's are
            from tokenfleet.producer import Client

            with Client(server.url, prefix=prefix) as client:
                for name in adapters:
                    client.submit(input_ids=[3, 4, 5], max_new_tokens=2, adapter=name).result(timeout=300)
        traces, wall = drive_threads(server.url, model, prefix, reqs, counters, use)
    row = summarize("tokenfleet", traces, wall)
    row["note"] = f"log: {log}" if log else ""
    return row


def run_vllm(
    model: str, dtype: str, reqs, adapters: dict[str, str], use: list[str | None], rank: int
) -> dict:
    spec = {
        "model": model,
        "dtype": dtype,
        "max_batch_size": len(reqs),
        "max_seq_len": max_seq_len_for(reqs),
        "requests": [
            {"prompt_ids": r.prompt_ids, "max_new_tokens": r.max_new_tokens, "arrival_s": 0.0, "adapter": a}
            for r, a in zip(reqs, use)
        ],
        "loras": adapters,
        "max_lora_rank": rank,
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        done = subprocess.run(
            [str(VLLM_VENV / "bin" / "python"), str(HERE / "peers" / "vllm_offline.py"), str(out)],
            input=json.dumps(spec),
            text=True,
            env={**os.environ, **vllm_best_env()},
            capture_output=True,
            cwd=tmp,
        )
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"vLLM failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        data = json.loads(out.read_text())
    traces = [Trace(s, t, i) for s, t, i in zip(data["submitted_at"], data["token_times"], data["token_ids"])]
    return summarize("vllm", traces, data["wall_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument(
        "--dtype",
        default="auto",
        help="vLLM's dtype; auto: the one the worker's default picks here (bfloat16 on CPUs with bf16 "
        "instructions, float32 otherwise, where vLLM-CPU's bf16 is emulated and ~5x slower)",
    )
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="tokenfleet-base,tokenfleet-lora,vllm-base,vllm-lora")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--adapters-dir", help="make the adapters here, or reuse those an earlier run made")
    args = p.parse_args()
    if args.dtype == "auto":
        from tokenfleet.engines.native.device import cpu_supports_bf16

        args.dtype = "bfloat16" if cpu_supports_bf16() else "float32"
    reqs = make_workload("fixed", args.requests, 128, 64, 0.0, 0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.adapters_dir or tmp) / f"rank{args.rank}"
        adapters = make_adapters(args.model, args.adapters, args.rank, root)
        names = list(adapters)
        use = [names[i % len(names)] for i in range(len(reqs))]
        systems = args.only.split(",")
        for round_ in range(args.rounds):
            for system in systems if round_ % 2 == 0 else systems[::-1]:
                lora = system.endswith("-lora")
                if system.startswith("tokenfleet"):
                    row = run_tokenfleet(args.model, reqs, adapters if lora else {}, use if lora else [])
                else:
                    row = run_vllm(
                        args.model,
                        args.dtype,
                        reqs,
                        adapters if lora else {},
                        use if lora else [None] * len(reqs),
                        args.rank,
                    )
                row.pop("_token_ids", None)
                row.update(system=system, round=round_)
                rows.append(row)
                print(json.dumps(row), flush=True)
    report(rows, systems, args)


def report(rows: list[dict], systems: list[str], args: argparse.Namespace) -> None:
    def speed(system: str, round_: int) -> float:
        return next(r["tokens_per_s"] for r in rows if r["system"] == system and r["round"] == round_)

    lines = [
        f"bench.lora, {host_kind()} ({platform.processor() or platform.machine()}), {os.cpu_count()} CPUs, "
        f"code {code_commit()}, {time.strftime('%Y-%m-%d')}, model {args.model} (vLLM in {args.dtype}), "
        f"{args.adapters} adapters of "
        f"rank {args.rank} on every linear, {args.requests} requests",
        "",
        "| system | tokens/s by round | median | TTFT p50 ms |",
        "|---|---|---|---|",
    ]
    for system in systems:
        mine = [r for r in rows if r["system"] == system]
        speeds = [r["tokens_per_s"] for r in mine]
        ttft = statistics.median(r["ttft_p50_ms"] for r in mine)
        by_round = " / ".join(f"{s:.0f}" for s in speeds)
        lines.append(f"| {system} | {by_round} | {statistics.median(speeds):.0f} | {ttft:.0f} |")
    pairs = [
        ("tokenfleet-lora", "tokenfleet-base"),
        ("tokenfleet-lora", "vllm-lora"),
        ("vllm-lora", "vllm-base"),
    ]
    lines.append("")
    for a, b in pairs:
        if a in systems and b in systems:
            ratios = [speed(a, k) / speed(b, k) for k in range(args.rounds)]
            by_round = " / ".join(f"{x:.2f}" for x in ratios)
            lines.append(f"{a} / {b}: {by_round}, median {statistics.median(ratios):.2f}x")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"lora-{stamp}.json").write_text(json.dumps(rows, indent=1))
    (out / f"lora-{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
