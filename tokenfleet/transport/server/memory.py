"""Is Redis allowed to drop our keys? Its ``maxmemory-policy``, read at start-up and on reconnect.

Redis is the fleet's only state: under any policy but ``noeviction``, a Redis that fills up
silently deletes keys (queued requests, reply streams, consumer groups) and callers wait for
answers that can no longer come. Like Sidekiq and Celery, we say so loudly at start-up, and with
``--strict-redis`` (the ``online`` profile's default) refuse to run on such a server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis

log = logging.getLogger(__name__)

SAFE_POLICY = "noeviction"
RECHECK_S = 30.0  # long-running processes re-read it this often (a restart, a CONFIG SET)


class EvictingRedis(RuntimeError):
    """``--strict-redis`` and a Redis that may evict keys."""


@dataclass(frozen=True)
class MemoryPolicy:
    """What the server says of its memory limit; ``policy`` None: it would not say (an ACL
    without INFO, a managed Redis that hides it)."""

    policy: str | None
    maxmemory: int | None
    unknown_reason: str | None = None

    @property
    def evicting(self) -> bool:
        """Whether Redis may delete keys on its own when full."""
        return self.policy is not None and self.policy != SAFE_POLICY

    def warning(self) -> str | None:
        """One line for the operator, or None when the policy is safe."""
        if not self.evicting:
            return None
        limit = f"maxmemory {self.maxmemory} bytes" if self.maxmemory else "no maxmemory set yet"
        return (
            f"redis maxmemory-policy is {self.policy} ({limit}): when full it deletes keys, and queued "
            f"requests and reply streams vanish; set `CONFIG SET maxmemory-policy noeviction` "
            "(see docs/operations/failure-modes.md, 'When Redis loses data')"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"maxmemory_policy": self.policy, "maxmemory": self.maxmemory, "evicting": self.evicting}


def read_memory_policy(client: Any) -> MemoryPolicy:
    """The server's policy from ``INFO memory`` (allowed where CONFIG is not, as on most managed
    Redis). On a cluster, the worst of its primaries."""
    try:
        info = client.info("memory")
    except (redis.ConnectionError, redis.TimeoutError):
        raise
    except redis.RedisError as e:  # e.g. NOPERM: the ACL leaves INFO out
        return MemoryPolicy(None, None, f"{type(e).__name__}: {e}")
    nodes = list(info.values()) if info and all(isinstance(v, dict) for v in info.values()) else [info]
    policies = [(str(n.get("maxmemory_policy")), int(n.get("maxmemory") or 0)) for n in nodes if n]
    if not policies:
        return MemoryPolicy(None, None, "INFO memory did not name a maxmemory_policy")
    policy, maxmemory = max(policies, key=lambda p: p[0] != SAFE_POLICY)
    return MemoryPolicy(policy, maxmemory)


def out_of_memory(info: dict[str, Any]) -> bool:
    """Whether Redis refuses writes now (``INFO memory``: used past ``maxmemory`` under
    ``noeviction``; on a cluster, any primary). Workers' heartbeats cannot be written then, so a
    stale one says nothing about the worker."""
    nodes = list(info.values()) if info and all(isinstance(v, dict) for v in info.values()) else [info]
    return any(
        n.get("maxmemory_policy") == SAFE_POLICY
        and 0 < int(n.get("maxmemory") or 0) <= int(n.get("used_memory") or 0)
        for n in nodes
        if n
    )


def check_memory_policy(
    client: Any, strict: bool, who: str, previous: MemoryPolicy | None = None
) -> MemoryPolicy:
    """Read the policy and warn (or, ``strict``, raise :class:`EvictingRedis`) when it evicts;
    said again only when it differs from ``previous`` (a periodic re-check stays quiet)."""
    policy = read_memory_policy(client)
    warning = policy.warning()
    if previous is not None and policy == previous:
        return policy
    if warning is not None:
        if strict:
            raise EvictingRedis(f"{who} refuses to run (--strict-redis): {warning}")
        log.warning("%s: %s", who, warning)
    elif policy.policy is None:
        log.info("%s: could not read redis maxmemory-policy (%s)", who, policy.unknown_reason)
    return policy
