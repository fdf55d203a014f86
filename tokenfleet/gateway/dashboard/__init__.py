"""The fleet at a glance in a browser: ``/dashboard`` on ``tokenfleet serve``, or alone with
``tokenfleet dashboard``. It reads only Redis (workers' heartbeats, the queues, the dead letters,
the bulk jobs, the fleet's time series) and acts on it for an admin."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable

from fastapi import FastAPI

from tokenfleet.gateway.dashboard.access import Access
from tokenfleet.gateway.dashboard.routes import Console, router
from tokenfleet.protocol import Keys
from tokenfleet.transport.server.connection import connect_async_client, connect_client


def open_console(redis_url: str, prefixes: Iterable[str], access: Access) -> Console:
    """A console over the fleets of ``prefixes`` (the first is shown first)."""
    fleets = {prefix: Keys(prefix) for prefix in dict.fromkeys(prefixes)}
    return Console(connect_client(redis_url), connect_async_client(redis_url), fleets, access)


async def close_console(console: Console) -> None:
    console.sync.close()
    await console.aio.aclose()


def standalone_app(redis_url: str, prefixes: Iterable[str], access: Access) -> FastAPI:
    """``tokenfleet dashboard``: the dashboard alone, for fleets run without a gateway."""
    prefixes = list(prefixes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.console = open_console(redis_url, prefixes, access)
        try:
            yield
        finally:
            await close_console(app.state.console)

    app = FastAPI(title="tokenfleet dashboard", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(router)
    return app


__all__ = ["Access", "Console", "close_console", "open_console", "router", "standalone_app"]
