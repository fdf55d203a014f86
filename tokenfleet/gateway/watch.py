"""A request in flight whose model no live worker serves any more ends with a 503 at once, not
after ``--request-timeout-s``: the last worker was killed, say. Workers' heartbeats say it (a
worker silent for ``STALE_AFTER_S`` is gone); a short grace lets a restarting one come back."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenfleet.gateway.errors import APIError
from tokenfleet.gateway.models import Fleet

POLL_S = 1.0
GRACE_S = 5.0  # past the heartbeat's staleness: a worker restarting under supervision returns


def orphaned(model: str) -> APIError:
    message = f"no live worker serves model {model!r} any more: the request was cancelled"
    return APIError(503, message, "api_error", "model_not_served", "model")


async def until_orphaned(fleet: Fleet, model: str) -> None:
    """Return once no live worker has served ``model`` for :data:`GRACE_S`."""
    missing_since: float | None = None
    while True:
        await asyncio.sleep(POLL_S)
        try:
            # a full Redis takes no heartbeats: quiet workers then are no sign of dead ones
            served = model in await fleet.models() or await fleet.redis_full()
        except (RedisConnectionError, RedisTimeoutError):  # Redis away is no verdict on the workers
            continue
        if served:
            missing_since = None
        elif missing_since is None:
            missing_since = time.monotonic()
        elif time.monotonic() - missing_since >= GRACE_S:
            return


async def unless_orphaned(work: asyncio.Future[Any], fleet: Fleet, model: str) -> Any:
    """``work``'s result, or :func:`orphaned`'s error (``work`` cancelled) if the model's workers
    are all gone first."""
    guard = asyncio.ensure_future(until_orphaned(fleet, model))
    try:
        done, _ = await asyncio.wait({work, guard}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this wait cancelled: so is the work
        work.cancel()
        raise
    finally:
        guard.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.wait({work})  # let it unwind (a stream's reader closes after it)
    raise orphaned(model)


async def orphaned_error(fleet: Fleet, model: str) -> BaseException:
    """:func:`orphaned`'s error, once the model's workers are all gone (for a stream's reader)."""
    await until_orphaned(fleet, model)
    return orphaned(model)
