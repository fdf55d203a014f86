"""Redis clients from URLs, cluster-aware: a URL naming any node of a Redis Cluster gets a
``RedisCluster`` client (it discovers the other nodes); a plain server gets a plain client."""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.cluster import RedisCluster


def is_cluster(url: str) -> bool:
    """Whether the server at ``url`` runs in cluster mode (one CLUSTER INFO round trip; a plain
    server answers it with an error)."""
    probe = redis.Redis.from_url(url, socket_connect_timeout=5, **client_identity())
    try:
        probe.execute_command("CLUSTER", "INFO")
        return True
    except redis.ResponseError:
        return False
    finally:
        probe.close()


def client_identity() -> dict[str, Any]:
    """What every new connection tells Redis (CLIENT SETINFO), worked out once. Left to itself,
    redis-py reads its own package metadata for each connection it opens (~0.4 ms, parsing the
    METADATA file): a client that opens a connection per concurrent submit or follow paid that
    per request of a burst. On Redis 7.2 and later, ``CLIENT LIST`` names tokenfleet too."""
    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # redis-py before 7: the same through lib_version
        return {"lib_version": redis.__version__}
    from tokenfleet import __version__

    info = DriverInfo(lib_version=redis.__version__).add_upstream_driver("tokenfleet", __version__)
    return {"driver_info": info}


def connect_client(url: str, **kwargs: Any) -> redis.Redis:
    kwargs = {**client_identity(), **kwargs}
    if is_cluster(url):
        kwargs.pop("health_check_interval", None)
        return RedisCluster.from_url(url, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def connect_async_client(url: str, **kwargs: Any) -> aioredis.Redis:
    kwargs = {**client_identity(), **kwargs}
    if is_cluster(url):
        return aioredis.RedisCluster.from_url(url, **kwargs)
    return aioredis.Redis.from_url(url, **kwargs)
