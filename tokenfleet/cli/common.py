"""What the commands share: the Redis options, one-line errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import click

from tokenfleet.errors import TokenfleetError

redis_url_option = click.option(
    "--redis-url",
    envvar="REDIS_URL",
    default=None,
    show_envvar=True,
    help="Redis URL (redis:// or rediss://, user:password@ allowed). Default redis://127.0.0.1:6379/0.",
)
prefix_option = click.option(
    "--prefix",
    envvar="TOKENFLEET_PREFIX",
    default=None,
    show_envvar=True,
    help="Prefix of every Redis key (default: tokenfleet).",
)
model_dir_option = click.option(
    "--model",
    "model_dir",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="Model directory whose tokenizer picks the bucket (else a worker routes the prompt).",
)


def fail(message: str) -> NoReturn:
    raise click.ClickException(message)


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """A user's mistake or an unreachable Redis is one line on stderr, not a traceback."""
    try:
        yield
    except (click.ClickException, click.exceptions.Exit, KeyboardInterrupt, SystemExit):
        raise
    except (TokenfleetError, ValueError) as e:
        fail(str(e))
    except Exception as e:  # redis errors, bad parameters
        fail(f"{type(e).__name__}: {e}")


def check_tokenizer_dir(model_dir: str | None) -> None:
    """A --model given to a producer must hold the tokenizer it routes with."""
    if model_dir is not None and not (Path(model_dir) / "tokenizer.json").exists():
        fail(f"{model_dir} has no tokenizer.json: give a Hugging Face model directory, or no --model")
