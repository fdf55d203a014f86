"""Helpers shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path


def model_or_built(model: str | None, size: str = "tiny") -> str:
    """The model directory to benchmark: the one given, else a ``size`` model built in a temp dir."""
    if model is not None:
        return model
    from tokenfleet.models import init_model

    return str(init_model(tempfile.mkdtemp(prefix="tokenfleet-bench-") + f"/{size}", size))


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile by nearest rank (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def pin_bf16_linear_route(dtype: str, device: str = "cpu") -> str | None:
    """Choose the bf16 linears' route (``TOKENFLEET_BF16_LINEAR``) once, here, and pin it in this
    process's environment, which its engines and the worker processes it starts inherit: under
    ``auto`` each engine measures the routes on its own, and on a drifting host a worker and the
    in-process engine it is compared with can land on different ones. Returns the route, or
    ``None`` where there is nothing to choose (not bf16, not the CPU, or already named)."""
    if dtype not in ("bfloat16", "bf16") or device != "cpu":
        return None
    named = os.environ.get("TOKENFLEET_BF16_LINEAR", "auto")
    if named != "auto":
        return named
    import torch

    from tokenfleet.engines.native.linear.routes import linear_route

    route = linear_route(torch.device("cpu"), torch.bfloat16)
    os.environ["TOKENFLEET_BF16_LINEAR"] = route
    return route


def code_commit() -> str:
    """The commit the measured code is (``+dirty`` with uncommitted changes), for the record of a
    figure: benchmarks.md shows which code each row measured."""
    here = Path(__file__).resolve().parent
    run = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, cwd=here)  # noqa: E731
    rev = run("rev-parse", "--short=7", "HEAD").stdout.strip() or "unknown"
    dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return rev + ("+dirty" if dirty else "")


def host_kind() -> str:
    """What kind of host a figure holds for: the CPU's vendor line, its widest matmul ISA and its
    core count (hosts differ: AVX2-only EPYCs, AVX-512 and AMX Xeons, AVX512-BF16 EPYCs)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    flags = set(next((ln for ln in info.splitlines() if ln.startswith("flags")), "").split())
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    vendor = "EPYC" if "EPYC" in name else "Xeon" if "Xeon" in name else name or "CPU"
    isa = next(
        (label for flag, label in ISA_LABELS if flag in flags),
        "x86-64" if "sse2" in flags else platform.machine(),
    )
    return f"{vendor} {isa}, {os.cpu_count()} vCPUs"


ISA_LABELS = (("amx_tile", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def pinned_bf16_linear() -> str:
    """The route :func:`pin_bf16_linear_route` pinned (``auto`` when none), for the engines this
    process builds itself (workers it starts read it from the environment, through their config)."""
    return os.environ.get("TOKENFLEET_BF16_LINEAR", "auto")


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def allocator_env() -> dict[str, str]:
    """tcmalloc preloaded when the machine has it: what vLLM's best configuration uses, given
    to tokenfleet's worker too (fewer page faults on its large per-step buffers)."""
    return {"LD_PRELOAD": TCMALLOC} if os.path.exists(TCMALLOC) else {}


@contextmanager
def worker_process(
    url: str,
    prefix: str,
    model: str,
    flags: list[str],
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    preexec: Callable[[], None] | None = None,
):
    """A ``tokenfleet worker`` process on ``url`` under ``prefix``, yielded once it has announced
    itself (after any ``--compile`` warm-up); SIGTERM, and a wait for it to finish, on exit.
    ``python``: the interpreter of the virtualenv it runs in (vLLM's, for ``--engine vllm``);
    ``preexec``: run in the child before it starts (a cgroup to join)."""
    import redis

    from tokenfleet.protocol import Keys

    log_path = os.environ.get("BENCH_WORKER_LOG")  # keep the worker's log (where its time went)
    log = open(log_path, "a") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    worker = subprocess.Popen(
        [python, "-m", "tokenfleet", "worker", "--model", model, *flags],
        env={**os.environ, **(env or {}), "REDIS_URL": url, "TOKENFLEET_PREFIX": prefix},
        stdout=subprocess.DEVNULL,
        stderr=log,
        preexec_fn=preexec,
    )
    try:
        admin = redis.Redis.from_url(url)
        while not admin.hlen(Keys(prefix).workers):
            if worker.poll() is not None:
                raise SystemExit(f"tokenfleet worker exited during start-up (rc {worker.returncode})")
            time.sleep(0.1)
        yield worker
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(120)
        except subprocess.TimeoutExpired:  # say so, but let the error that brought us here show
            print("the worker did not stop within 120 s of SIGTERM: killed", file=sys.stderr)
            worker.kill()
            worker.wait()
        if log_path:
            log.close()
