"""Configuration: frozen dataclasses that own every default, and their loading (flag > env >
file > profile > default, in :mod:`tokenfleet.config.loading`)."""

from tokenfleet.config.batching import DEFAULT_BUCKETS, MODES, PADDINGS, DynamicBatchingConfig
from tokenfleet.config.engine import ENGINE_BACKENDS, EngineConfig, KVCacheConfig
from tokenfleet.config.gateway import GatewayConfig
from tokenfleet.config.loading import (
    GATEWAY_SETTINGS,
    PROFILES,
    WORKER_SETTINGS,
    cache_dir,
    load_config_file,
    prefix_from_env,
    redis_url_from_env,
    resolve_gateway_config,
    resolve_worker_config,
    worker_config,
)
from tokenfleet.config.settings import Spec, flatten, parse_buckets, parse_size
from tokenfleet.config.worker import (
    DEFAULT_PREFIX,
    DEFAULT_REDIS_URL,
    OVERLAP_MODES,
    RedisConfig,
    ReliabilityConfig,
    StreamingConfig,
    WorkerConfig,
)

__all__ = [
    "DEFAULT_BUCKETS",
    "DEFAULT_PREFIX",
    "DEFAULT_REDIS_URL",
    "ENGINE_BACKENDS",
    "GATEWAY_SETTINGS",
    "MODES",
    "OVERLAP_MODES",
    "PADDINGS",
    "PROFILES",
    "WORKER_SETTINGS",
    "DynamicBatchingConfig",
    "EngineConfig",
    "GatewayConfig",
    "KVCacheConfig",
    "RedisConfig",
    "ReliabilityConfig",
    "Spec",
    "StreamingConfig",
    "WorkerConfig",
    "cache_dir",
    "flatten",
    "load_config_file",
    "parse_buckets",
    "parse_size",
    "prefix_from_env",
    "redis_url_from_env",
    "resolve_gateway_config",
    "resolve_worker_config",
    "worker_config",
]
