"""bench.compare's tokenfleet rows: the engine in this process, and a worker process on its own
Redis driven by asyncio clients; the CPU each side spent (:class:`CpuCounters`).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from bench.common import pinned_bf16_linear, worker_process
from bench.workload import Req, Trace, summarize
from tokenfleet.config import DynamicBatchingConfig

DEFAULT_MAX_PREFILL_TOKENS = DynamicBatchingConfig().max_prefill_tokens


class InProcessEngine:
    """tokenfleet's engine and scheduler in this process (continuous batching, no Redis), built and
    warmed up (compiled, when asked) once; :meth:`burst` serves requests at their arrival times."""

    def __init__(
        self,
        model_dir: str,
        dtype: str,
        reqs: list[Req],
        max_batch_size: int,
        max_seq_len: int,
        compile: bool = False,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        device: str = "cpu",
    ):
        from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig
        from tokenfleet.engines.native.runner import ModelRunner

        self.reqs = reqs  # the workload its KV pool is sized for
        kv = KVCacheConfig(num_blocks=pool_blocks(reqs, max_batch_size))
        self.runner = ModelRunner(
            EngineConfig(
                model=model_dir, device=device, dtype=dtype, compile=compile, bf16_linear=pinned_bf16_linear()
            ),
            kv,
            DynamicBatchingConfig(max_batch_size=max_batch_size),
        )
        self.runner.warm_up()  # compiles (when asked) before the clock starts, as the worker does
        self.batching = DynamicBatchingConfig(
            mode="continuous",
            max_wait_ms=0,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            buckets=(max_seq_len // 2,),
            max_prefill_tokens=max_prefill_tokens,
        )
        self.note = (
            f"scheduler + paged engine, continuous, in process, max_prefill_tokens {max_prefill_tokens}"
        )
        self.note += ", --compile" if compile else ""
        self._serve([(Req([3, 4, 5], 2, 0.0), Trace(0.0))])  # warm-up

    def burst(self, reqs: list[Req]) -> tuple[list[Trace], float]:
        """Serve ``reqs`` (each at its ``arrival_s``); their traces and the wall time it took."""
        traces = [Trace(0.0) for _ in reqs]
        start = time.perf_counter()
        self._serve(list(zip(reqs, traces)))
        return traces, time.perf_counter() - start

    def _serve(self, batch: list[tuple[Req, Trace]]) -> None:
        from tokenfleet.core.offline import finished_in, run_offline
        from tokenfleet.core.sequence import SeqState
        from tokenfleet.engines.native.core import NativeCore
        from tokenfleet.protocol import Request

        runner = self.runner

        def seq(i: int, req: Req, arrival: float) -> SeqState:
            request = Request(
                id=f"r{i}",
                input_ids=tuple(req.prompt_ids),
                max_new_tokens=req.max_new_tokens,
                ignore_eos=True,
            )
            return SeqState(i, request, list(req.prompt_ids), runner.tokenizer, runner.eos_token_ids, arrival)

        def on_token(out) -> None:
            trace = batch[out.seq.key][1]
            trace.token_ids.append(out.token_id)
            trace.token_times.append(time.perf_counter())

        start = time.perf_counter()
        for req, trace in batch:
            trace.arrival = start + req.arrival_s
        arrivals = [(req.arrival_s, seq(i, req, start + req.arrival_s)) for i, (req, _) in enumerate(batch)]
        finished_in(run_offline(NativeCore(runner, self.batching), arrivals, on_token))


def run_engine(*args: Any, **kwargs: Any) -> dict:
    """The ``tokenfleet-engine`` rows: one burst on a fresh :class:`InProcessEngine` (same
    arguments)."""
    runner = InProcessEngine(*args, **kwargs)
    traces, wall = runner.burst(runner.reqs)
    name = "tokenfleet-engine" + ("-compile" if kwargs.get("compile") else "")
    return summarize(name, traces, wall, runner.note)


def pool_blocks(reqs: list[Req], max_batch_size: int, block_size: int = 16) -> int:
    """A KV pool that holds ``max_batch_size`` of the longest requests (no preemption)."""
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs)
    return max_batch_size * (-(-longest // block_size) + 1)


def worker_flags(
    dtype: str,
    reqs: list[Req],
    max_batch_size: int,
    max_seq_len: int,
    wait_ms: float,
    stream_interval_ms: float,
    compile: bool,
    max_prefill_tokens: int,
) -> list[str]:
    """``tokenfleet worker`` flags for the native end-to-end rows: :func:`queue_flags`, a KV pool
    that holds a full batch of its longest requests, and the native engine's own settings."""
    flags = queue_flags(dtype, max_batch_size, max_seq_len, wait_ms, stream_interval_ms)
    flags += ["--num-blocks", str(pool_blocks(reqs, max_batch_size))]
    flags += ["--max-prefill-tokens", str(max_prefill_tokens), "--compile" if compile else "--no-compile"]
    return flags


def queue_flags(
    dtype: str, max_batch_size: int, max_seq_len: int, wait_ms: float, stream_interval_ms: float
) -> list[str]:
    """What every end-to-end row's worker shares, whatever its engine: continuous batching, one
    bucket that holds the workload, the wait and the stream interval."""
    flags = ["--dtype", dtype, "--buckets", str(max_seq_len // 2), "--max-seq-len", str(max_seq_len)]
    flags += ["--mode", "continuous", "--max-wait-ms", str(wait_ms), "--max-batch-size", str(max_batch_size)]
    return flags + ["--stream-interval-ms", str(stream_interval_ms)]


def run_e2e(
    model_dir: str,
    dtype: str,
    reqs: list[Req],
    max_batch_size: int,
    max_seq_len: int,
    wait_ms: float,
    stream_interval_ms: float = 0.0,
    compile: bool = False,
    shared_client: bool = True,
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
    device: str = "cpu",
    overlap_io: str = "auto",
    threads: int | None = None,
) -> dict:

    from tokenfleet.producer import AsyncClient
    from tokenfleet.transport.server.embedded import EmbeddedRedis

    prefix = f"compare-{os.getpid()}"
    flags = worker_flags(
        dtype, reqs, max_batch_size, max_seq_len, wait_ms, stream_interval_ms, compile, max_prefill_tokens
    )
    flags += ["--device", device, "--overlap-io", overlap_io]
    flags += ["--threads", str(threads)] if threads else []
    with EmbeddedRedis() as server, worker_process(server.url, prefix, model_dir, flags) as worker:
        counters = CpuCounters(server.url, worker.pid)  # the worker preloads tcmalloc itself
        traces, wall = asyncio.run(
            drive_clients(server.url, model_dir, prefix, reqs, AsyncClient, shared_client, counters)
        )
    clients = "through one asyncio client" if shared_client else "a client each"
    note = f"worker process + Redis, {len(reqs)} concurrent requests {clients}, max_wait_ms {wait_ms:g}"
    note += f", stream_interval_ms {stream_interval_ms:g}, max_prefill_tokens {max_prefill_tokens}"
    note += ", --compile" if compile else ""
    note += f", --overlap-io {overlap_io}"
    note += f", --threads {threads}" if threads else ""
    suffix = {"auto": "", "off": "-serial-io", "on": "-overlap-io"}[overlap_io]
    suffix += "-reserved-cpu" if threads else ""
    name = "tokenfleet-e2e" + ("-compile" if compile else "") + suffix
    row = summarize(name, traces, wall, note)
    return {**row, **counters.used}


class CpuCounters:
    """CPU seconds the client (this process), Redis and the worker used between :meth:`start` and
    :meth:`stop`: on a small host the three share its cores, and what the client and Redis take
    is what an end-to-end row loses against the engine in process."""

    def __init__(self, url: str, worker_pid: int):
        import redis

        self.admin, self.worker_pid = redis.Redis.from_url(url), worker_pid
        self.used: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        info = self.admin.info("cpu")
        fields = Path(f"/proc/{self.worker_pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return {
            "client_cpu_s": time.process_time(),
            "redis_cpu_s": info["used_cpu_user"] + info["used_cpu_sys"],
            "worker_cpu_s": (int(fields[11]) + int(fields[12])) / ticks,  # utime + stime
        }

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> None:
        end = self._read()
        self.used = {k: round(end[k] - self._start[k], 2) for k in end}


async def drive_clients(
    url: str,
    model_dir: str,
    prefix: str,
    reqs: list[Req],
    client_cls,
    shared: bool = True,
    counters: CpuCounters | None = None,
):
    """Each request submitted at its arrival time and streamed token by token, concurrently: through
    one client (``shared``: as an API server proxying its users would; it follows every reply
    stream with one XREAD) or a client each (each following its own stream). ``counters`` are
    read around the timed part."""
    traces = [Trace(0.0) for _ in reqs]
    async with client_cls(url, model=model_dir, prefix=prefix) as warm:  # warm-up request
        await (await warm.submit(input_ids=[3, 4, 5], max_new_tokens=2, ignore_eos=True)).result(timeout=300)

    async def one(client, req: Req, trace: Trace, start: float) -> float:
        await client.buckets()  # connected, and the fleet's buckets known, before it arrives
        await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
        trace.arrival = time.perf_counter()
        handle = await client.submit(
            input_ids=req.prompt_ids, max_new_tokens=req.max_new_tokens, ignore_eos=True
        )
        async for chunk in handle.stream(timeout=600):
            now = time.perf_counter()
            trace.token_ids.extend(chunk.token_ids)
            trace.token_times.extend([now] * len(chunk.token_ids))
        return time.perf_counter()  # its terminal event is in

    async def own_client(req: Req, trace: Trace, start: float) -> float:
        async with client_cls(url, model=model_dir, prefix=prefix) as client:
            return await one(client, req, trace, start)

    start = time.perf_counter() + 0.5  # every client connected before the first arrival
    if counters:
        counters.start()
    if shared:
        async with client_cls(url, model=model_dir, prefix=prefix) as client:
            ends = await asyncio.gather(*(one(client, r, t, start) for r, t in zip(reqs, traces)))
    else:
        ends = await asyncio.gather(*(own_client(r, t, start) for r, t in zip(reqs, traces)))
    if counters:
        counters.stop()
    return traces, max(ends) - start  # until the last result is in, not the clients' teardown
