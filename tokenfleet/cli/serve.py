"""``tokenfleet serve``: the OpenAI-compatible HTTP gateway; its options come from the config."""

from __future__ import annotations

import logging
from typing import Any

import click
import redis

from tokenfleet.cli.common import fail, settings_options
from tokenfleet.config import GATEWAY_SETTINGS, resolve_gateway_config


@click.command(short_help="Serve OpenAI's HTTP API over the fleet (stateless; run many).")
@settings_options(GATEWAY_SETTINGS)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="TOML file of gateway settings (flag names as keys, top level or under [gateway]).",
)
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
def serve(config_file: str | None, log_level: str, **flags: Any) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages, /v1/embeddings,
    /v1/models, the Batch API (/v1/files, /v1/batches), /health and /metrics over this fleet's
    queue. All state is in Redis: run as
    many replicas as you like behind a load balancer; a stream dropped by one resumes on another
    (Last-Event-ID). Every setting comes from a flag, TOKENFLEET_<FLAG>, the --config file or
    its default.
    """
    try:
        config = resolve_gateway_config(flags, config_file=config_file)
    except ValueError as e:
        fail(str(e))
    import uvicorn

    from tokenfleet.gateway.app import create_app
    from tokenfleet.transport.server.connection import connect_client
    from tokenfleet.transport.server.memory import EvictingRedis, check_memory_policy

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:  # before listening: a refusal is one line, not a failed lifespan's traceback
        check_memory_policy(connect_client(config.redis.url), config.redis.strict, "gateway")
    except EvictingRedis as e:
        fail(str(e))
    except (redis.ConnectionError, redis.TimeoutError) as e:
        fail(f"redis unreachable at {config.redis.url}: {e}")

    try:
        app = create_app(config)
    except ValueError as e:
        fail(str(e))
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level.lower())
