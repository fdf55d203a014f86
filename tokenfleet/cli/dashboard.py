"""``tokenfleet dashboard``: the gateway's /dashboard alone, for fleets run without a gateway."""

from __future__ import annotations

import secrets

import click
import redis

from tokenfleet.cli.common import fail, redis_url_option
from tokenfleet.config import prefix_from_env, redis_url_from_env


def _keys(value: str | None) -> frozenset[str]:
    return frozenset(k.strip() for k in (value or "").split(",") if k.strip())


@click.command(short_help="Serve the fleet's dashboard in a browser (no gateway needed).")
@redis_url_option
@click.option(
    "--prefix",
    "prefixes",
    multiple=True,
    envvar="TOKENFLEET_PREFIX",
    show_envvar=True,
    help="A fleet's key prefix (repeatable: one fleet per prefix; default: tokenfleet).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8100, show_default=True, help="Port to listen on.")
@click.option(
    "--admin-keys",
    envvar="TOKENFLEET_ADMIN_KEYS",
    show_envvar=True,
    default=None,
    help="Comma-separated keys that may view and act (requeue, delete, cancel). Without admin or "
    "viewer keys, one admin key is made up and printed with the page's address.",
)
@click.option(
    "--viewer-keys",
    envvar="TOKENFLEET_VIEWER_KEYS",
    show_envvar=True,
    default=None,
    help="Comma-separated keys that may only view.",
)
def dashboard(
    redis_url: str | None,
    prefixes: tuple[str, ...],
    host: str,
    port: int,
    admin_keys: str | None,
    viewer_keys: str | None,
) -> None:
    """Serve a live page of the fleet at http://HOST:PORT/dashboard: workers (stale ones marked),
    queues per bucket, lane and shard, the last hour's throughput, TTFT and queue time, a request
    looked up by id and followed live, dead letters (requeue, delete) and batch jobs (cancel). It
    reads only Redis; actions need an admin key and are logged."""
    import uvicorn

    from tokenfleet.gateway.dashboard import Access, standalone_app
    from tokenfleet.transport.server.connection import connect_client

    url = redis_url_from_env(redis_url)
    admins, viewers = _keys(admin_keys), _keys(viewer_keys)
    made_up = None
    if not admins and not viewers:  # never an open page that can requeue and delete
        made_up = secrets.token_urlsafe(18)
        admins = frozenset({made_up})
    try:
        connect_client(url).ping()
    except (redis.ConnectionError, redis.TimeoutError) as e:
        fail(f"redis unreachable at {url}: {e}")
    fleets = list(prefixes) or [prefix_from_env(None)]
    where = f"http://{host}:{port}/dashboard"
    click.echo(f"dashboard of fleet(s) {', '.join(fleets)} at {where}", err=True)
    if made_up is not None:
        click.echo(f"admin key (this run only): open {where}#key={made_up}", err=True)
    app = standalone_app(url, fleets, Access(admins, viewers))
    uvicorn.run(app, host=host, port=port, log_level="warning")
