"""A worker's whole configuration: nested frozen sections, each owning its defaults."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.config.batching import DynamicBatchingConfig
from tokenfleet.config.engine import EngineConfig, KVCacheConfig
from tokenfleet.config.settings import section, setting

OVERLAP_MODES = ("auto", "on", "off")
DEFAULT_PREFIX = "tokenfleet"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class RedisConfig:
    """Where the fleet's keys live."""

    url: str = setting(
        DEFAULT_REDIS_URL,
        "Redis URL: redis:// or rediss:// (user:password@ allowed; any node of a Cluster), or "
        "redis+sentinel://host:26379,host2:26379/SERVICE/0 for the master Sentinels name.",
        flag="redis_url",
        env_aliases=("REDIS_URL",),
    )
    prefix: str = setting(DEFAULT_PREFIX, "Prefix of every Redis key.")
    strict: bool = setting(
        False,
        "Refuse to run on a Redis whose maxmemory-policy may evict keys (anything but "
        "noeviction); without it, a loud warning. The online profile's default.",
        flag="strict_redis",
    )


@dataclass(frozen=True)
class ReliabilityConfig:
    """Taking over dead workers' requests, poison entries, queue bounds."""

    claim_idle_ms: int = setting(
        30_000, "Take over requests another worker has left idle this long (it died)."
    )
    max_attempts: int = setting(3, "Deliveries of one request before it is dead-lettered.")
    queue_timeout_s: float | None = setting(
        None, "Fail requests that waited longer than this before starting (deadline_exceeded).", kind="float"
    )
    max_queue: int | None = setting(
        None, "Undelivered interactive requests a bucket may hold; producers then get QueueFull.", kind="int"
    )
    batch_max_queue: int | None = setting(
        None, "The same for the batch lane (bulk jobs may queue far more).", kind="int"
    )
    trim_interval_s: float = setting(
        5.0, "How often acknowledged entries are trimmed from the request streams."
    )
    steal_after_ms: int = setting(
        500,
        "Prefix affinity: take a request from a shard another live worker owns only once it has "
        "waited there this long (its owner holds the prefix's KV cache). 0: no affinity, every "
        "worker reads every shard alike.",
    )

    def __post_init__(self) -> None:
        if self.claim_idle_ms < 100:
            raise ValueError(f"claim_idle_ms must be >= 100, got {self.claim_idle_ms!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts!r}")
        if self.queue_timeout_s is not None and self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s!r}")
        for name in ("max_queue", "batch_max_queue"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        if self.steal_after_ms < 0:
            raise ValueError(f"steal_after_ms must be >= 0, got {self.steal_after_ms!r}")
        if self.trim_interval_s <= 0:
            raise ValueError(f"trim_interval_s must be > 0, got {self.trim_interval_s!r}")


@dataclass(frozen=True)
class StreamingConfig:
    """How replies go out."""

    stream_interval_ms: float = setting(
        0.0,
        "Send a request's tokens at most this often, several per event (0: every token as made; the "
        "first and last always at once). Fewer Redis writes and client wake-ups per token.",
    )
    overlap_io: str = setting(
        "auto",
        "While a batch runs, send each step's tokens and read new work on an I/O thread during the "
        "next step, instead of between steps: shorter steps, but new requests and cancels take effect "
        "one step later. auto: when that round trip is at least 5% of a step (fast models).",
        choices=OVERLAP_MODES,
    )
    exchange_interval_ms: float = setting(
        5.0,
        "While a batch runs and a step has nothing to send, read new work and cancels at most this "
        "often (each step otherwise pays a round trip for reads that mostly come back empty).",
    )

    def __post_init__(self) -> None:
        if self.stream_interval_ms < 0:
            raise ValueError(f"stream_interval_ms must be >= 0, got {self.stream_interval_ms!r}")
        if self.exchange_interval_ms < 0:
            raise ValueError(f"exchange_interval_ms must be >= 0, got {self.exchange_interval_ms!r}")
        if self.overlap_io not in OVERLAP_MODES:
            raise ValueError(f"overlap_io must be one of {', '.join(OVERLAP_MODES)}, got {self.overlap_io!r}")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs. Every default lives on its field; ``tokenfleet worker``'s options
    are generated from these fields (see :mod:`tokenfleet.config.loading`)."""

    engine: EngineConfig = section(EngineConfig)
    batching: DynamicBatchingConfig = section(DynamicBatchingConfig)
    kv: KVCacheConfig = section(KVCacheConfig)
    reliability: ReliabilityConfig = section(ReliabilityConfig)
    streaming: StreamingConfig = section(StreamingConfig)
    redis: RedisConfig = section(RedisConfig)
    name: str | None = setting(None, "Consumer name (default: host-pid-random).", kind="str")
    metrics_port: int | None = setting(None, "Serve Prometheus metrics on this port (/metrics).", kind="int")
    otlp_traces_endpoint: str | None = setting(
        None,
        "Send spans of traced requests (those with a traceparent) over OTLP/HTTP to this URL, e.g. "
        "http://collector:4318/v1/traces (needs tokenfleet[otel]); default: none recorded.",
        kind="str",
    )
