"""Configuration objects: the batching knobs and the worker's settings.

``DynamicBatchingConfig`` mirrors the Ascend ATB/MindIE knob set (``max_wait_ms``,
``max_batch_size``, ``max_seq_len``, bucketed padding vs pad-to-max). Every field is validated
in ``__post_init__`` with a ``ValueError`` naming the field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MODES = ("static", "dynamic", "continuous")
PADDINGS = ("bucket", "max")
OVERLAP_MODES = ("auto", "on", "off")
ENGINE_BACKENDS = ("native", "vllm", "auto")
DEFAULT_BUCKETS = (128, 256, 512)
DEFAULT_MAX_PREFILL_TOKENS = 2048  # prompt tokens one continuous-mode prefill step may take
DEFAULT_PREFIX = "tokenfleet"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


PROFILES: dict[str, dict[str, object]] = {
    # the seed's two deployments: latency-bound chat, throughput-bound batch jobs
    "online": {"max_wait_ms": 50, "max_batch_size": 16, "max_seq_len": 4096},
    "offline": {
        "max_wait_ms": 2000,
        "max_batch_size": 64,
        "max_seq_len": 8192,
        "stream_interval_ms": 200,
        "max_prefill_tokens": 8192,  # throughput first: whole batches, fewer extra decode steps
    },
}


def load_config_file(path: str) -> dict[str, object]:
    """Settings from a TOML file: keys are flag names (dashes or underscores), at the top level or
    under ``[worker]``."""
    import tomllib

    with open(path, "rb") as f:
        data = tomllib.load(f)
    table = data.get("worker", data)
    return {str(k).replace("-", "_"): v for k, v in table.items() if not isinstance(v, dict)}


def redis_url_from_env(url: str | None = None) -> str:
    """The Redis URL to use: the argument, else ``REDIS_URL``, else the local default."""
    return url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def prefix_from_env(prefix: str | None = None) -> str:
    """The key prefix to use: the argument, else ``TOKENFLEET_PREFIX``, else ``tokenfleet``."""
    return prefix or os.environ.get("TOKENFLEET_PREFIX") or DEFAULT_PREFIX


def parse_buckets(text: str) -> tuple[int, ...]:
    """Parse ``"128,256,512"`` into a sorted tuple, with a clear error on junk."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise ValueError(f"buckets must be comma-separated integers, got {text!r}") from e
    return tuple(sorted(set(values)))


@dataclass(frozen=True)
class DynamicBatchingConfig:
    """When a worker dispatches a batch, and how prompts are grouped and padded.

    - ``static``: dispatch only when ``max_batch_size`` requests are pending.
    - ``dynamic``: dispatch when ``max_batch_size`` are pending or the oldest pending request has
      waited ``max_wait_ms``, whichever comes first; the batch runs to completion.
    - ``continuous``: like ``dynamic`` for the first batch; afterwards waiting requests join the
      running batch at the next step while slots and KV blocks allow.

    ``padding='bucket'`` never mixes buckets in one batch; ``'max'`` mixes them and pads every
    prompt to the longest one in the batch.

    ``max_prefill_tokens`` (continuous mode; MindIE's ``maxPrefillTokens``): prompt tokens one
    prefill step may take. A batch over it starts in parts, a decode step between them, so the
    first part's requests get their first token after a fraction of the whole prefill, and the
    running ones keep streaming. A prompt longer than the budget still starts, alone.
    """

    max_wait_ms: float = 50.0
    max_batch_size: int = 32
    max_seq_len: int = 2048
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    padding: str = "bucket"
    mode: str = "continuous"
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS

    def __post_init__(self) -> None:
        if not (isinstance(self.max_wait_ms, (int, float)) and self.max_wait_ms >= 0):
            raise ValueError(f"max_wait_ms must be a number >= 0, got {self.max_wait_ms!r}")
        if not (isinstance(self.max_batch_size, int) and self.max_batch_size >= 1):
            raise ValueError(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if not (isinstance(self.max_seq_len, int) and self.max_seq_len >= 2):
            raise ValueError(f"max_seq_len must be an integer >= 2, got {self.max_seq_len!r}")
        buckets = tuple(self.buckets)
        if not buckets:
            raise ValueError("buckets must not be empty")
        if any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"buckets must be positive integers, got {buckets!r}")
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be strictly increasing, got {buckets!r}")
        if buckets[-1] >= self.max_seq_len:
            raise ValueError(
                f"buckets: the largest bucket ({buckets[-1]}) must be below max_seq_len ({self.max_seq_len}) "
                "to leave room for generated tokens"
            )
        if not (isinstance(self.max_prefill_tokens, int) and self.max_prefill_tokens >= 1):
            raise ValueError(f"max_prefill_tokens must be an integer >= 1, got {self.max_prefill_tokens!r}")
        if self.padding not in PADDINGS:
            raise ValueError(f"padding must be one of {PADDINGS}, got {self.padding!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        object.__setattr__(self, "buckets", buckets)

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000.0

    @property
    def largest_bucket(self) -> int:
        return self.buckets[-1]


@dataclass(frozen=True)
class KVCacheConfig:
    """Size of the paged KV pool: an explicit block count, or a memory budget in bytes."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks!r}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"memory_bytes must be >= 1, got {self.memory_bytes!r}")


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """Parse ``"2GiB"``, ``"512MiB"``, ``"1000000"`` into bytes."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 512MiB or 2GiB")
    return int(float(num) * _UNITS[unit])


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs besides the batching knobs."""

    model: str
    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = DEFAULT_PREFIX
    batching: DynamicBatchingConfig = DynamicBatchingConfig()
    kv: KVCacheConfig = KVCacheConfig()
    device: str = "auto"
    dtype: str = "auto"
    name: str | None = None
    max_new_tokens_cap: int = 4096
    threads: int | None = None
    claim_idle_ms: int = 30_000  # an entry idle this long belongs to a dead worker
    max_attempts: int = 3  # deliveries before an entry is dead-lettered
    queue_timeout_s: float | None = None  # server-side bound on waiting before the start
    max_queue: int | None = None  # undelivered entries a bucket stream may hold (producers check)
    metrics_port: int | None = None  # serve Prometheus /metrics here
    stream_interval_ms: float = 0.0  # coalesce a request's tokens into one event per interval
    compile: bool = False  # torch.compile decode and prefill (minutes of warm-up at start)
    overlap_io: str = "auto"  # a busy step's Redis round trip during the next step: auto|on|off
    engine: str = "native"  # the engine backend: native|vllm|auto (vLLM where it pays)

    def __post_init__(self) -> None:
        if self.claim_idle_ms < 100:
            raise ValueError(f"claim_idle_ms must be >= 100, got {self.claim_idle_ms!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts!r}")
        if self.queue_timeout_s is not None and self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s!r}")
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.overlap_io not in OVERLAP_MODES:
            raise ValueError(f"overlap_io must be one of {', '.join(OVERLAP_MODES)}, got {self.overlap_io!r}")
        if self.stream_interval_ms < 0:
            raise ValueError(f"stream_interval_ms must be >= 0, got {self.stream_interval_ms!r}")
        if self.engine not in ENGINE_BACKENDS:
            raise ValueError(f"engine must be one of {', '.join(ENGINE_BACKENDS)}, got {self.engine!r}")
        if self.max_new_tokens_cap < 1:
            raise ValueError(f"max_new_tokens_cap must be >= 1, got {self.max_new_tokens_cap!r}")
