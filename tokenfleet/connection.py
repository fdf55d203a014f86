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
    probe = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        probe.execute_command("CLUSTER", "INFO")
        return True
    except redis.ResponseError:
        return False
    finally:
        probe.close()


def connect_client(url: str, **kwargs: Any) -> redis.Redis:
    if is_cluster(url):
        kwargs.pop("health_check_interval", None)
        return RedisCluster.from_url(url, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def connect_async_client(url: str, **kwargs: Any) -> aioredis.Redis:
    if is_cluster(url):
        return aioredis.RedisCluster.from_url(url, **kwargs)
    return aioredis.Redis.from_url(url, **kwargs)
