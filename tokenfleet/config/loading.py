"""Where settings come from, in one place. For every setting, the first of: a command-line flag,
the environment (``TOKENFLEET_<FLAG>``, e.g. ``TOKENFLEET_MAX_WAIT_MS=20``), the ``--config``
TOML file, the ``--profile``, the field's default. No other module reads the environment."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenfleet.config.gateway import GatewayConfig
from tokenfleet.config.model_fit import fit_to_model, model_context_length
from tokenfleet.config.settings import ENV_PREFIX, Spec, build, specs
from tokenfleet.config.worker import DEFAULT_PREFIX, DEFAULT_REDIS_URL, WorkerConfig

PROFILES: dict[str, dict[str, Any]] = {
    # the two usual deployments: latency-bound chat, throughput-bound batch jobs
    "online": {"max_wait_ms": 50, "max_batch_size": 16, "max_seq_len": 4096, "strict_redis": True},
    "offline": {
        "max_wait_ms": 2000,
        "max_batch_size": 64,
        "max_seq_len": 8192,
        "stream_interval_ms": 200,
        "max_prefill_tokens": 8192,  # throughput first: whole batches, fewer extra decode steps
    },
}

WORKER_SETTINGS: tuple[Spec, ...] = tuple(specs(WorkerConfig))
"""Every worker setting, flat, by flag name (the CLI makes one option of each)."""
GATEWAY_SETTINGS: tuple[Spec, ...] = tuple(specs(GatewayConfig))
"""Every gateway setting, the same way."""


def load_config_file(path: str, table: str = "worker") -> dict[str, Any]:
    """Settings from a TOML file: keys are flag names (dashes or underscores), at the top level or
    under ``[<table>]`` (``[worker]``, ``[gateway]``)."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    chosen = data.get(table, data)
    return {str(k).replace("-", "_"): v for k, v in chosen.items() if not isinstance(v, dict)}


def resolve_worker_config(
    flags: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
    profile: str | None = None,
) -> WorkerConfig:
    """The worker's config from its layers. ``flags``: values given on the command line, by flag
    name (None: not given). Raises ``ValueError`` naming the setting and where it came from."""
    environ = os.environ if environ is None else environ
    from_file = load_config_file(config_file) if config_file else {}
    profile_name = profile or environ.get(ENV_PREFIX + "PROFILE") or from_file.pop("profile", None)
    if profile_name is not None and profile_name not in PROFILES:
        raise ValueError(f"unknown profile {profile_name!r}; use one of {sorted(PROFILES)}")
    layers = [(f"profile {profile_name}", PROFILES.get(profile_name or "", {}))]
    config: WorkerConfig
    config, given = _resolve(WorkerConfig, WORKER_SETTINGS, flags, environ, config_file, from_file, layers)
    if not {"max_seq_len", "buckets"} <= given:
        context = model_context_length(config.engine.model) if config.engine.model else None
        config = dataclasses.replace(config, batching=fit_to_model(config.batching, context, given))
    return config


def resolve_gateway_config(
    flags: Mapping[str, Any], environ: Mapping[str, str] | None = None, config_file: str | None = None
) -> GatewayConfig:
    """The gateway's config from its layers (no profiles; ``[gateway]`` in a TOML file)."""
    environ = os.environ if environ is None else environ
    from_file = load_config_file(config_file, "gateway") if config_file else {}
    config: GatewayConfig
    config, _ = _resolve(GatewayConfig, GATEWAY_SETTINGS, flags, environ, config_file, from_file, [])
    return config


def _resolve(
    cls: type,
    settings: tuple[Spec, ...],
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    config_file: str | None,
    from_file: Mapping[str, Any],
    lower: Sequence[tuple[str, Mapping[str, Any]]],
) -> tuple[Any, set[str]]:
    """Each setting from the first layer that has it: flag, environment, file, ``lower`` layers;
    returns the config and the names of the settings some layer gave (the rest are defaults)."""
    unknown = set(from_file) - {spec.name for spec in settings}
    if unknown:
        raise ValueError(f"unknown settings in {config_file}: {', '.join(sorted(unknown))}")
    layers = [("--config", from_file), *lower]
    values: dict[str, Any] = {}
    for spec in settings:
        if flags.get(spec.name) is not None:
            values[spec.name] = spec.parse(flags[spec.name], spec.flag)
            continue
        found = _from_env(spec, environ) or next(
            ((where, layer[spec.name]) for where, layer in layers if layer.get(spec.name) is not None), None
        )
        if found is not None:
            values[spec.name] = spec.parse(found[1], found[0])
    return build(cls, values), set(values)


def worker_config(**settings: Any) -> WorkerConfig:
    """A worker config from settings by flag name, as a TOML file holds them
    (``worker_config(model="./tiny", max_wait_ms=20)``); unknown names raise ``ValueError``."""
    known = {spec.name: spec for spec in WORKER_SETTINGS}
    unknown = set(settings) - set(known)
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    config: WorkerConfig = build(
        WorkerConfig, {k: known[k].parse(v, "the caller") for k, v in settings.items()}
    )
    return config


def _from_env(spec: Spec, environ: Mapping[str, str]) -> tuple[str, str] | None:
    for name in spec.env:
        if environ.get(name):
            return name, environ[name]
    return None


def redis_url_from_env(url: str | None = None) -> str:
    """The Redis URL a client uses: the argument, else ``REDIS_URL``, else the local default."""
    return url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def prefix_from_env(prefix: str | None = None) -> str:
    """The key prefix a client uses: the argument, else ``TOKENFLEET_PREFIX``, else ``tokenfleet``."""
    return prefix or os.environ.get(ENV_PREFIX + "PREFIX") or DEFAULT_PREFIX


def cache_dir() -> Path:
    """Where tokenfleet keeps what it builds or fetches once per machine (models, CPU kernels):
    ``$XDG_CACHE_HOME/tokenfleet``, else ``~/.cache/tokenfleet``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenfleet"


def kernel_cache_dirs() -> list[Path]:
    """Where CPU kernel builds are looked for, in order: ``TOKENFLEET_KERNEL_CACHE`` when set
    (then only there), else this process's cache home and the user's default one (a process with a
    cache home of its own still finds the machine's build). New builds go in the first."""
    if os.environ.get(ENV_PREFIX + "KERNEL_CACHE"):
        return [Path(os.environ[ENV_PREFIX + "KERNEL_CACHE"])]
    dirs = [cache_dir() / "kernels", Path.home() / ".cache" / "tokenfleet" / "kernels"]
    return dirs[:1] if dirs[0] == dirs[1] else dirs


def openmp_wait_policy() -> str:
    """How this process's idle OpenMP threads wait (``OMP_WAIT_POLICY``, read once by the runtime).
    The worker leaves OpenMP's default, which measured fastest alone and, with the thread count
    re-measured while serving, beside a neighbour too (docs/PERFORMANCE.md, "Sharing a machine")."""
    return os.environ.get("OMP_WAIT_POLICY") or "OpenMP's default (spin briefly, then sleep)"
