"""``submit``, ``result``, ``cancel``: one request from the command line."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
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


def _client(redis_url: str | None, model_dir: str | None, prefix: str | None) -> Any:
    from tokenfleet.producer import Client

    return Client(redis_url, model=model_dir, prefix=prefix)


@click.command(short_help="Enqueue a prompt and stream its text.")
@click.argument("prompt")
@redis_url_option
@prefix_option
@model_dir_option
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 means greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 disables top-k.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (reproducible outputs).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS.")
@click.option(
    "--json-schema",
    "json_schema",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A JSON schema file: the output is JSON that validates against it.",
)
@click.option("--regex", default=None, help="A regular expression the whole output must match.")
@click.option(
    "--logprobs",
    type=click.IntRange(0, 20),
    default=None,
    help="Report each token's logprob and this many alternatives (shown with --json).",
)
@click.option("--min-tokens", type=int, default=None, help="Hold back EOS and stop tokens until this many.")
@click.option("--presence-penalty", type=float, default=None, help="OpenAI's, -2 to 2.")
@click.option("--frequency-penalty", type=float, default=None, help="OpenAI's, -2 to 2.")
@click.option("--repetition-penalty", type=float, default=None, help="Hugging Face's, above 0 (1: off).")
@click.option("--adapter", default=None, help="A LoRA adapter of the fleet (`tokenfleet lora list`).")
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
    prompt: str,
    redis_url: str | None,
    prefix: str | None,
    model_dir: str | None,
    timeout: float,
    as_json: bool,
    request_id: str | None,
    detach: bool,
    stop: tuple[str, ...],
    json_schema: str | None,
    regex: str | None,
    **params: Any,
) -> None:
    """Enqueue PROMPT and stream the generated text to stdout (the request id goes to stderr at
    once, for `tokenfleet result ID` and `tokenfleet cancel ID`)."""
    params = {k: v for k, v in {**params, "stop": stop or None}.items() if v is not None}
    handle = None
    try:
        with one_line_errors():
            if json_schema is not None and regex is not None:
                raise click.UsageError("give --json-schema or --regex, not both")
            if json_schema is not None:
                schema = json.loads(Path(json_schema).read_text())
                params["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
            elif regex is not None:
                params["response_format"] = {"type": "regex", "regex": regex}
            check_tokenizer_dir(model_dir)
            with _client(redis_url, model_dir, prefix) as client:
                handle = client.submit(prompt, request_id=request_id, **params)
                _exit_on_ctrl_c(lambda: _client(redis_url, None, prefix), handle.id, detach)
                click.echo(f"request {handle.id}", err=True)
                _say_if_nobody_serves(client, handle)
                if as_json:
                    click.echo(json.dumps(asdict(client.result(handle.id, timeout=timeout))))
                    return
                for chunk in handle.stream(timeout=timeout):
                    click.echo(chunk.text, nl=False)
                click.echo()
    except KeyboardInterrupt:  # before the request was sent: nothing to cancel
        raise SystemExit(130) from None


def _exit_on_ctrl_c(new_client: Any, request_id: str, detach: bool) -> None:
    """From here on, Ctrl-C cancels the request (or, with --detach, leaves it), says so and exits
    at once: a KeyboardInterrupt raised wherever the main thread happens to be (inside the reply
    reader's locks, a thread's start) could leave the exit waiting on them."""
    import os
    import signal
    import sys

    def on_interrupt(signum: int, frame: Any) -> None:
        if detach:
            click.echo(f"\nleft request {request_id} running: tokenfleet result {request_id}", err=True)
        else:
            with new_client() as fresh:  # its own connections: the interrupted ones may be mid-command
                fresh.cancel(request_id)
            click.echo(
                f"\ninterrupted: cancelled request {request_id} (--detach leaves it running)", err=True
            )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)

    signal.signal(signal.SIGINT, on_interrupt)


def _say_if_nobody_serves(client: Any, handle: Any) -> None:
    """Say at once when no live worker serves the request's bucket under this prefix: it stays
    queued and starts when one does (a mistyped --prefix looks just like this)."""
    from tokenfleet.transport.registry import serving_workers

    if not serving_workers(client.redis, client.keys, handle.bucket):
        where = f"bucket {handle.bucket}" if handle.bucket not in (None, "auto") else "any bucket"
        click.echo(
            f"no live worker serves {where} under prefix {client.keys.prefix!r}: the request stays "
            "queued and starts when one does; waiting (Ctrl-C cancels it)",
            err=True,
        )


@click.command(short_help="Print a request's result as JSON.")
@click.argument("request_id")
@redis_url_option
@prefix_option
@click.option("--timeout", type=float, default=300.0, show_default=True)
def result(request_id: str, redis_url: str | None, prefix: str | None, timeout: float) -> None:
    """Print the result of REQUEST_ID (submitted anywhere, earlier) as JSON."""
    with one_line_errors(), _client(redis_url, None, prefix) as client:
        _check_exists(client, request_id)
        click.echo(json.dumps(asdict(client.result(request_id, timeout=timeout))))


@click.command(short_help="Cancel a request, queued or running.")
@click.argument("request_id")
@redis_url_option
@prefix_option
def cancel(request_id: str, redis_url: str | None, prefix: str | None) -> None:
    """Cancel REQUEST_ID: a queued request never starts, a running one stops within one step (or
    ~5 ms, when steps are shorter)."""
    with one_line_errors(), _client(redis_url, None, prefix) as client:
        _check_exists(client, request_id)
        client.cancel(request_id)
    click.echo(f"cancelled {request_id}")


def _check_exists(client: Any, request_id: str) -> None:
    """Fail at once for an id that cannot be a request, or names none under this prefix."""
    from tokenfleet.producer.lookup import request_exists
    from tokenfleet.protocol import valid_request_id

    if not valid_request_id(request_id):
        fail(f"{request_id!r} is not a request id (1-128 characters from A-Z a-z 0-9 . _ : -)")
    if not request_exists(client.redis, client.keys, request_id):
        fail(
            f"no such request {request_id!r} under prefix {client.keys.prefix!r}: no reply stream, "
            "not queued (expired, never submitted, or another --prefix?)"
        )
