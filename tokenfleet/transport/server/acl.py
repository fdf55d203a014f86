"""Redis ACL rules for the roles of a fleet: producers, workers and monitors.

Producers may only enqueue (through the backpressure script), read reply streams, cancel, read
the bucket list, the workers' heartbeats (to say when nobody serves a request) and the adapter
registry; workers may
only do what serving needs, on the fleet's keys; monitors (``tokenfleet status``, dashboards)
may only read. Print them with ``tokenfleet acl``; ``docs/operations/secure.md`` shows them for the
default prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.protocol import Keys

# Commands every client library sends on connect or to check the connection.
_CONNECT = [
    "+ping",
    "+hello",
    "+auth",
    "+select",
    "+readonly",
    "+info",  # INFO memory: may Redis evict our keys (maxmemory-policy), checked at start-up
]  # client libraries ignore a refused CLIENT SETINFO
# redis-py runs scripts with EVALSHA and loads them on a cache miss.
_SCRIPTS = ["+eval", "+evalsha", "+script|load", "+script|exists"]  # EXISTS: scripts in a pipeline

PRODUCER_COMMANDS = (
    _CONNECT
    + _SCRIPTS
    + [
        "+xadd",
        "+xlen",
        "+xinfo|groups",
        "+hget",  # the enqueue script (KEYS: request stream, max_queue)
        "+xread",
        "+xrange",  # follow and replay reply streams
        "+set",  # cancel flags
        "+smembers",  # the bucket list
        "+exists",  # does a request or its reply exist (batch's resume, result and cancel)
        "+xrevrange",  # a queued request, looked for by id (in the served buckets' streams)
        "+hgetall",  # the workers' heartbeats: is anyone serving this bucket
        "+multi",
        "+exec",  # the empty reply stream and the request, enqueued together
    ]
)
MONITOR_COMMANDS = _CONNECT + [
    "+hgetall",
    "+hget",  # Batch API records
    "+get",  # which entry owns a request id
    "+xpending",  # which worker holds a request
    "+xread",  # a reply followed live
    "+ttl",  # how long a reply is kept
    "+smembers",
    "+exists",
    "+xinfo|groups",
    "+xlen",
    "+xrange",
    "+xrevrange",
    "+scan",
]
WORKER_COMMANDS = (
    _CONNECT
    + _SCRIPTS
    + [
        "+xreadgroup",
        "+xack",
        "+xautoclaim",
        "+xclaim",
        "+xpending",
        "+xgroup|create",
        "+xinfo|groups",
        "+xadd",
        "+xtrim",
        "+xrange",
        "+xlen",
        "+expire",
        "+hset",
        "+hincrby",  # the fleet's time series ({P}:series:<slot>)
        "+hincrbyfloat",
        "+hdel",
        "+sadd",
        "+srem",
        "+smembers",
        "+hgetall",
        "+hget",  # an adapter's record in the registry
        "+exists",
        "+xread",
        "+xrevrange",
        "+set",
        "+get",
        "+time",  # the read script's steal cutoff is on Redis's clock
    ]
)


def producer_key_patterns(prefix: str) -> list[str]:
    keys = Keys(prefix)
    return [
        f"%RW~{keys.tag}:req:*",
        f"%R~{prefix}:reply:*",
        f"%W~{prefix}:cancel:*",
        f"%W~{keys.cancels}",
        f"%R~{keys.buckets}",
        # EVAL needs read-write access to every key it declares; +hget is the only hash command
        # producers have, so they still cannot change the limit
        f"~{keys.max_queue}",
        f"~{prefix}:client:*",  # asyncio clients' wake-up streams (XADD, XREAD)
        f"%R~{prefix}:owner:*",
        f"%R~{keys.workers}",
        f"%R~{keys.adapters}",  # which LoRA adapters the fleet serves (adding one is an admin's)
    ]


def producer_selectors(prefix: str) -> list[str]:
    """Rights on some keys only (Redis 7 selectors): expiring and deleting a wake-up stream must
    not let a producer expire or delete request streams."""
    # and the empty reply stream made with each request (a consumer group created and dropped
    # at once, then its TTL) must not let it write events there
    reply = f"(+xgroup|create +xgroup|destroy +expire ~{prefix}:reply:*)"
    return [f"(+expire +del ~{prefix}:client:*)", reply]


def worker_key_patterns(prefix: str) -> list[str]:
    keys = Keys(prefix)
    return [
        f"~{keys.tag}:req:*",
        f"~{prefix}:reply:*",
        f"~{prefix}:owner:*",
        f"~{keys.dead_letter}",
        f"~{keys.buckets}",
        f"~{keys.workers}",
        f"~{keys.max_queue}",
        f"~{keys.adapters}",  # its --lora adapters, written at start
        f"~{prefix}:series:*",  # what it did, summed per 10 s for the dashboard's charts
        f"%R~{prefix}:cancel:*",
        f"%R~{keys.cancels}",
    ]


def setuser_args(
    user: str, password: str, commands: list[str], patterns: list[str], selectors: Sequence[str] = ()
) -> list[str]:
    """Arguments of ``ACL SETUSER`` that (re)define ``user`` from scratch with exactly these rights."""
    return [user, "reset", "on", f">{password}", "resetchannels", "-@all", *commands, *patterns, *selectors]


def monitor_key_patterns(prefix: str) -> list[str]:
    """Read-only, on every key of the prefix."""
    return [f"%R~{pattern}" for pattern in Keys(prefix).patterns]


def acl_rules(
    prefix: str, producer_password: str, worker_password: str, monitor_password: str | None = None
) -> list[list[str]]:
    """``ACL SETUSER`` argument lists for the ``tokenfleet-producer`` and ``tokenfleet-worker``
    users, and ``tokenfleet-monitor`` when it has a password."""
    monitor = (
        [setuser_args("tokenfleet-monitor", monitor_password, MONITOR_COMMANDS, monitor_key_patterns(prefix))]
        if monitor_password
        else []
    )
    return [
        setuser_args(
            "tokenfleet-producer",
            producer_password,
            PRODUCER_COMMANDS,
            producer_key_patterns(prefix),
            producer_selectors(prefix),
        ),
        setuser_args("tokenfleet-worker", worker_password, WORKER_COMMANDS, worker_key_patterns(prefix)),
        *monitor,
    ]
