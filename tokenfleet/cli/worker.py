"""``tokenfleet worker``: its options are generated from the config's fields, so every default and
help text exists once (in :mod:`tokenfleet.config`)."""

from __future__ import annotations

import gc
import json
import logging
import signal
from pathlib import Path
from typing import Any

import click

from tokenfleet.cli.common import fail, require_engine, settings_options
from tokenfleet.config import PROFILES, WORKER_SETTINGS, flatten, resolve_worker_config
from tokenfleet.config.cpus import cpu_share
from tokenfleet.config.loading import openmp_wait_policy
from tokenfleet.transport.server.memory import EvictingRedis
from tokenfleet.worker.process import malloc


@click.command(short_help="Serve requests from bucket streams (until SIGTERM).")
@settings_options(WORKER_SETTINGS)
@click.option(
    "--profile",
    type=click.Choice(sorted(PROFILES)),
    default=None,
    help="online: max_wait_ms 50, max_batch_size 16, max_seq_len 4096; offline: 2000, 64, 8192, "
    "stream_interval_ms 200 and max_prefill_tokens 8192.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="TOML file of worker settings (flag names as keys, top level or under [worker]).",
)
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.option("--dry-run", is_flag=True, help="Print the resolved settings as JSON and exit.")
def worker(profile: str | None, config_file: str | None, log_level: str, dry_run: bool, **flags: Any) -> None:
    """Serve requests from the bucket streams until SIGTERM/SIGINT (then finish what is held).

    Every setting comes from, in order of precedence: a command-line flag, a TOKENFLEET_<FLAG>
    environment variable (e.g. TOKENFLEET_MAX_WAIT_MS=20), the --config TOML file, the --profile,
    the built-in default.
    """
    require_engine("worker")
    try:
        config = resolve_worker_config(flags, config_file=config_file, profile=profile)
    except ValueError as e:
        fail(str(e))
    if not config.engine.model:
        fail("no model: give --model DIR (or TOKENFLEET_MODEL, or model in the --config file)")
    _check_model_dir(config.engine.model)
    threads = threads_chosen(config.engine.threads)
    if dry_run:
        chosen = {"threads_chosen": threads, "omp_wait_policy": openmp_wait_policy()}
        click.echo(json.dumps({**flatten(config), **chosen}, indent=2))
        return
    try:
        malloc.arrange(config.engine.allocator)  # may re-execute this process, before torch loads
    except ValueError as e:
        fail(str(e))
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker_log = logging.getLogger("tokenfleet.worker")
    worker_log.info(malloc.describe())
    worker_log.info("threads: %s; OpenMP waits: %s", threads, openmp_wait_policy())
    # Loading makes ~400k long-lived objects (torch, transformers, the model), and the collector
    # scanned them all seven times on the way (0.9 s of a 5 s SmolLM2 start): off while loading,
    # then one collection (what loading left in cycles) and the survivors frozen out of later scans.
    gc.disable()
    from tokenfleet.worker.loop import Worker

    try:
        w = Worker(config)
        w.upkeep.check_redis_memory(strict=config.redis.strict)
    except (ValueError, EvictingRedis) as e:
        fail(str(e))
    gc.collect()
    gc.freeze()
    gc.enable()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: w.stop())
    try:
        w.run()
    finally:
        # frozen objects outlive the interpreter's last collection, and nanobind (in triton, which
        # torch imports) then printed ~100 lines of "leaked instance" warnings at every exit
        gc.unfreeze()


def threads_chosen(asked: int | None) -> str:
    """What the worker's thread count will be, and why, in a phrase."""
    if asked is not None:
        return f"{asked} (--threads)"
    share = cpu_share()
    return (
        f"{share.threads} at start ({share.describe()}), re-measured while serving: fewer while other "
        "work takes these CPUs"
    )


def _check_model_dir(model_dir: str) -> None:
    """One line for a --model that cannot be a Hugging Face model directory, before any loading."""
    path = Path(model_dir)
    if not path.is_dir():
        fail(f"--model {model_dir}: no such directory")
    missing = [name for name in ("config.json",) if not (path / name).exists()]
    if not any(path.glob("tokenizer*")):
        missing.append("tokenizer.json (or tokenizer files)")
    if missing:
        fail(
            f"--model {model_dir} is not a Hugging Face model directory: no {' or '.join(missing)} "
            "(build a test model with `tokenfleet model init DIR`, or point at a saved model)"
        )
