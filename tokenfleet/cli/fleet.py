"""``status``, ``batch``, ``rq-worker``, ``acl``: the fleet as a whole."""

from __future__ import annotations

import json
import shlex
from typing import Any

import click

from tokenfleet.cli.common import (
    check_tokenizer_dir,
    fail,
    model_dir_option,
    one_line_errors,
    prefix_option,
    redis_url_option,
)
from tokenfleet.config import prefix_from_env, redis_url_from_env
from tokenfleet.protocol import LANES


@click.command(short_help="Show workers, queues and dead letters.")
@redis_url_option
@prefix_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(redis_url: str | None, prefix: str | None, as_json: bool) -> None:
    """Show the fleet from Redis alone: live workers (buckets, device, running, throughput, KV use,
    prefix-cache hit rate: prompt tokens found cached) and per-bucket queue depth, pending, oldest
    waiting age, dead letters."""
    from tokenfleet.protocol import Keys
    from tokenfleet.transport.server.connection import connect_client
    from tokenfleet.transport.status import fleet_status

    with one_line_errors():
        report = fleet_status(connect_client(redis_url_from_env(redis_url)), Keys(prefix_from_env(prefix)))
    click.echo(json.dumps(report, indent=2) if as_json else format_status(report))


def format_status(status: dict[str, Any]) -> str:
    """``tokenfleet status``'s table."""
    lines = [f"fleet {status['prefix']!r}: {sum(w['alive'] for w in status['workers'])} live worker(s)"]
    memory = status.get("redis") or {}
    if memory.get("evicting"):  # the first thing an operator must see
        lines.append(
            f"WARNING: redis maxmemory-policy is {memory['maxmemory_policy']}: when full it deletes "
            "queued requests and reply streams (set it to noeviction)"
        )
    elif memory.get("maxmemory_policy") is None:
        lines.append("redis maxmemory-policy: unknown (INFO refused)")
    if memory.get("out_of_memory"):  # workers look dead then: their heartbeats cannot be written
        lines.append(
            "WARNING: redis is out of memory (maxmemory reached): submits are refused, workers hold "
            "their tokens and cannot heartbeat; raise maxmemory or free memory"
        )
    lines.append("")
    lines.append(
        f"{'worker':<28} {'state':<6} {'buckets':<16} {'engine':<7} {'device':<8} "
        f"{'running':>7} {'waiting':>7} {'tok/s':>8} {'done':>7} {'KV used':>11} {'prefix hits':>11} "
        f"{'shards':>6} adapters"
    )
    for w in status["workers"]:
        kv = f"{w.get('kv_blocks_used', 0)}/{w.get('kv_blocks_total', 0)}"
        queries = w.get("prefix_cache_queries", 0)
        hits = f"{w.get('prefix_cache_hits', 0) / queries:.0%}" if queries else "-"
        served = ",".join(map(str, w.get("buckets", [])))
        lines.append(
            f"{w['name'][:28]:<28} {'alive' if w['alive'] else 'stale':<6} {served:<16} "
            f"{w.get('engine', 'native'):<7} {w.get('device', '?'):<8} "
            f"{w.get('running', 0):>7} {w.get('waiting', 0):>7} "
            f"{w.get('tokens_per_s', 0):>8} {w.get('finished', 0):>7} {kv:>11} {hits:>11} "
            f"{w.get('shards_owned', '-'):>6} {','.join(w.get('adapters') or []) or '-'}"
        )
    lines += ["", f"{'bucket':<8} {'lane':<12} {'depth':>7} {'pending':>8} {'oldest waiting':>15}"]
    for name, q in status["queues"].items():
        oldest = "-" if q["oldest_waiting_s"] is None else f"{q['oldest_waiting_s']:.1f}s"
        bucket, lane = q.get("bucket", name), q.get("lane", "")
        lines.append(f"{bucket!s:<8} {lane:<12} {q['depth']:>7} {q['pending']:>8} {oldest:>15}")
    lines += ["", f"dead letters: {status['dead_letters']}"]
    return "\n".join(lines)


@click.command(short_help="Run a JSONL file of prompts; results in order.")
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
@model_dir_option
@click.option("--max-new-tokens", type=int, default=None, help="Default for lines that do not set it.")
@click.option("--window", type=int, default=64, show_default=True, help="Requests in flight at once.")
@click.option(
    "--priority",
    type=click.Choice(LANES),
    default=LANES[1],
    show_default=True,
    help="Priority lane of lines that do not set one: batch queues behind interactive traffic.",
)
@click.option("--enqueue", is_flag=True, help="Run it as an RQ job (JSON serializer) and print the job id.")
def batch(
    input_path: str,
    output_path: str,
    redis_url: str | None,
    prefix: str | None,
    model_dir: str | None,
    max_new_tokens: int | None,
    window: int,
    priority: str,
    enqueue: bool,
) -> None:
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
    from tokenfleet.producer import bulk, rq_jobs

    defaults: dict[str, Any] = {"priority": priority}
    if max_new_tokens:
        defaults["max_new_tokens"] = max_new_tokens
    url, pre = redis_url_from_env(redis_url), prefix_from_env(prefix)
    with one_line_errors():
        if enqueue:
            job_id = rq_jobs.enqueue_batch(url, pre, model_dir, input_path, output_path, defaults)
            click.echo(job_id)
            hint = f"run `tokenfleet rq-worker --prefix {pre}` to process it"
            click.echo(f"queued on RQ queue {rq_jobs.rq_queue(pre)!r}; {hint}", err=True)
            return
        from tqdm import tqdm

        from tokenfleet.producer import Client

        check_tokenizer_dir(model_dir)
        total = len(bulk.read_inputs(input_path, defaults))
        with Client(url, model=model_dir, prefix=pre) as client, tqdm(total=total, unit="prompt") as bar:
            counts = bulk.run_batch(client, input_path, output_path, defaults, window, progress=bar.update)
    click.echo(
        f"{counts['done']} done, {counts['failed']} failed, {counts['skipped']} already in {output_path}"
    )
    if counts["failed"]:
        raise SystemExit(1)


@click.command("rq-worker", short_help="Process bulk jobs queued with batch --enqueue.")
@redis_url_option
@prefix_option
@click.option("--burst", is_flag=True, help="Exit once the queue is empty.")
def rq_worker(redis_url: str | None, prefix: str | None, burst: bool) -> None:
    """Process tokenfleet's RQ jobs (batch --enqueue) with the JSON serializer; the queue is named
    after the prefix. Plain `rq worker` works too:
    rq worker tokenfleet --serializer rq.serializers.JSONSerializer --url URL"""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from tokenfleet.producer.rq_jobs import prompt_exit_worker, rq_queue
    from tokenfleet.transport.server.connection import connect_server

    with one_line_errors():
        connection = connect_server(redis_url_from_env(redis_url))
        connection.ping()
        queue = Queue(rq_queue(prefix_from_env(prefix)), connection=connection, serializer=JSONSerializer)
        worker = prompt_exit_worker()([queue], connection=connection, serializer=JSONSerializer)
        worker.work(burst=burst)


@click.command(short_help="Print ACL rules for producer, worker and monitor users.")
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
    from tokenfleet.transport.server.acl import acl_rules

    try:
        rules = acl_rules(prefix_from_env(prefix), producer_password, worker_password, monitor_password)
    except ValueError as e:
        fail(str(e))
    for args in rules:
        click.echo("ACL SETUSER " + " ".join(shlex.quote(a) for a in args))
