"""Redis clients from URLs, cluster- and Sentinel-aware: a URL naming any node of a Redis Cluster
gets a ``RedisCluster`` client (it discovers the other nodes); a ``redis+sentinel://`` URL gets a
client of the master its Sentinels name, which follows a failover to the new master; a plain
server gets a plain client."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from redis.cluster import RedisCluster

log = logging.getLogger(__name__)

BACKOFF_START_S, BACKOFF_MAX_S = 0.1, 60.0


SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")


@dataclass(frozen=True)
class SentinelURL:
    """``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]``: the Sentinels
    to ask, the master's service name, the database, and the master's credentials (rediss+: TLS
    to the master and the Sentinels)."""

    sentinels: list[tuple[str, int]]
    service: str
    db: int
    username: str | None
    password: str | None
    ssl: bool

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        scheme, rest = url.split("://", 1)
        auth, _, hosts_path = rest.rpartition("@")
        hosts, _, path = hosts_path.partition("/")
        parts = [p for p in path.split("/") if p]
        if not hosts or not parts:
            raise ValueError(f"a Sentinel URL needs hosts and a service name: {url!r}")
        sentinels = []
        for host in hosts.split(","):
            name, _, port = host.rpartition(":") if ":" in host else (host, "", "26379")
            sentinels.append((name, int(port)))
        username, _, password = auth.partition(":") if auth else ("", "", "")
        db = int(parts[1]) if len(parts) > 1 else 0
        ssl = scheme.startswith("rediss")
        return cls(
            sentinels, unquote(parts[0]), db, unquote(username) or None, unquote(password) or None, ssl
        )

    def master_kwargs(self) -> dict[str, Any]:
        return {"db": self.db, "username": self.username, "password": self.password, "ssl": self.ssl}


def is_sentinel(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEMES)


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
    if is_sentinel(url):
        where = SentinelURL.parse(url)
        sentinel = redis.sentinel.Sentinel(where.sentinels, sentinel_kwargs={"ssl": where.ssl}, **kwargs)
        return cast(redis.Redis, sentinel.master_for(where.service, **where.master_kwargs()))
    if is_cluster(url):
        kwargs.pop("health_check_interval", None)
        return cast(redis.Redis, RedisCluster.from_url(url, **kwargs))
    return redis.Redis.from_url(url, **kwargs)


def connect_server(url: str) -> redis.Redis:
    """A client of one server, for RQ (which has no Cluster support): the master a Sentinel URL
    names (followed across failovers), else the URL's server."""
    return connect_client(url) if is_sentinel(url) else redis.Redis.from_url(url, **client_identity())


def connect_async_client(url: str, **kwargs: Any) -> aioredis.Redis:
    """The asyncio twin of :func:`connect_client`."""
    kwargs = {**client_identity(), **kwargs}
    if is_sentinel(url):
        where = SentinelURL.parse(url)
        sentinel = aiosentinel.Sentinel(where.sentinels, sentinel_kwargs={"ssl": where.ssl}, **kwargs)
        return cast(aioredis.Redis, sentinel.master_for(where.service, **where.master_kwargs()))
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
