"""``tokenfleet lora``: the fleet's LoRA adapters, added and removed while workers serve."""

from __future__ import annotations

from pathlib import Path

import click

from tokenfleet.cli.common import one_line_errors, prefix_option, redis_url_option
from tokenfleet.config import prefix_from_env, redis_url_from_env
from tokenfleet.protocol import Keys
from tokenfleet.protocol.adapters import AdapterRecord, check_adapter_name
from tokenfleet.transport.adapters import AdapterRegistry


@click.group(short_help="Add, remove and list the fleet's LoRA adapters (no worker restarts).")
def lora() -> None:
    """LoRA adapters (PEFT directories) the fleet serves on a base model. A request names one in
    its `adapter` field (or, at the gateway, as its `model`); every worker of the base loads it
    when a request first needs it, into one of its --max-loras slots."""


def _registry(redis_url: str | None, prefix: str | None) -> AdapterRegistry:
    from tokenfleet.transport.server.connection import connect_server

    return AdapterRegistry(connect_server(redis_url_from_env(redis_url)), Keys(prefix_from_env(prefix)))


@lora.command("add")
@click.argument("name")
@click.argument("directory")
@click.option("--base", default=None, help="The served model it adapts (default: whichever a worker serves).")
@redis_url_option
@prefix_option
def add(name: str, directory: str, base: str | None, redis_url: str | None, prefix: str | None) -> None:
    """Serve adapter NAME from DIRECTORY: a path each worker of the base can read (a PEFT
    directory: adapter_config.json and adapter_model.safetensors)."""
    with one_line_errors():
        check_adapter_name(name)
        if Path(directory).exists() and not (Path(directory) / "adapter_config.json").is_file():
            raise ValueError(f"{directory} holds no adapter_config.json: not a PEFT adapter directory")
        registry = _registry(redis_url, prefix)
        known = registry.get(name)
        if known is not None and known.path != directory:  # workers hold an adapter by its name
            raise ValueError(f"adapter {name!r} is served from {known.path}: new weights take a new name")
        registry.add(AdapterRecord(name, directory, base))
        click.echo(f"adapter {name} -> {directory}" + (f" (base {base})" if base else ""))


@lora.command("remove")
@click.argument("name")
@redis_url_option
@prefix_option
def remove(name: str, redis_url: str | None, prefix: str | None) -> None:
    """Stop serving adapter NAME (workers evict it when their slots are needed)."""
    with one_line_errors():
        if not _registry(redis_url, prefix).remove(name):
            raise ValueError(f"no adapter {name!r} here")
        click.echo(f"removed adapter {name}")


@lora.command("list")
@redis_url_option
@prefix_option
def list_adapters(redis_url: str | None, prefix: str | None) -> None:
    """The adapters the fleet serves: name, base, directory."""
    with one_line_errors():
        for name, record in sorted(_registry(redis_url, prefix).all().items()):
            click.echo(f"{name}\t{record.base or '-'}\t{record.path}")
