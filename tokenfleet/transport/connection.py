"""Redis clients from URLs, cluster-aware: a URL naming any node of a Redis Cluster gets a
``RedisCluster`` client (it discovers the other nodes); a plain server gets a plain client."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis.cluster import RedisCluster

log = logging.getLogger(__name__)

BACKOFF_START_S, BACKOFF_MAX_S = 0.1, 60.0


def is_cluster(url: str) -> bool:
    """Whether the server at ``url`` runs in cluster mode (one CLUSTER INFO round trip; a plain
    server answers it with an error)."""
    probe = redis.Redis.from_url(url, socket_connect_timeout=5, **client_identity())
    try:
        probe.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
        return True
    except redis.ResponseError:
        return False
    finally:
        probe.close()


def client_identity() -> dict[str, Any]:
    """What every new connection tells Redis (CLIENT SETINFO), worked out once. Left to itself,
    redis-py reads its own package metadata for each connection it opens, which a client opening
    a connection per concurrent submit paid per request. On Redis 7.2 and later, ``CLIENT LIST``
    names tokenfleet too."""
    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # redis-py before 7: the same through lib_version
        return {"lib_version": redis.__version__}
    from tokenfleet import __version__

    info = DriverInfo(lib_version=redis.__version__).add_upstream_driver("tokenfleet", __version__)
    return {"driver_info": info}


def connect_client(url: str, **kwargs: Any) -> redis.Redis:
    """A client for ``url``; a ``RedisCluster`` (which answers the same commands) on a cluster."""
    kwargs = {**client_identity(), **kwargs}
    if is_cluster(url):
        kwargs.pop("health_check_interval", None)
        return cast(redis.Redis, RedisCluster.from_url(url, **kwargs))
    return redis.Redis.from_url(url, **kwargs)


def connect_async_client(url: str, **kwargs: Any) -> aioredis.Redis:
    """The asyncio twin of :func:`connect_client`."""
    kwargs = {**client_identity(), **kwargs}
    if is_cluster(url):
        return cast(aioredis.Redis, aioredis.RedisCluster.from_url(url, **kwargs))
    return aioredis.Redis.from_url(url, **kwargs)


def connect_with_retry(url: str, should_stop: Callable[[], bool] = lambda: False) -> redis.Redis:
    """A worker's client: while the server cannot be reached (a fleet whose Redis restarts), retried
    with capped backoff, as the worker's loop does, until ``should_stop``."""
    backoff = BACKOFF_START_S
    while True:
        try:
            return connect_client(url, socket_keepalive=True, health_check_interval=30)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            if should_stop():
                raise
            log.warning("redis unavailable at start-up (%s); retrying in %.1fs", e, backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
