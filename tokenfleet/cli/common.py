"""What the commands share: the Redis options, one-line errors."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import click

from tokenfleet.config import Spec
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


def require_engine(command: str) -> None:
    """One line, not an ImportError, where the light install lacks what ``command`` runs."""
    import importlib.util

    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        needs = " and ".join(missing)
        fail(f"`tokenfleet {command}` runs models, which needs {needs}: pip install 'tokenfleet[worker]'")


def check_tokenizer_dir(model_dir: str | None) -> None:
    """A --model given to a producer must hold the tokenizer it routes with."""
    if model_dir is not None and not (Path(model_dir) / "tokenizer.json").exists():
        fail(f"{model_dir} has no tokenizer.json: give a Hugging Face model directory, or no --model")


_CLICK_TYPES: dict[str, Any] = {
    "int": int,
    "float": float,
    "str": str,
    "path": click.Path(exists=True, file_okay=False),
    "buckets": str,  # parsed by the config, so that a flag and a file say the same thing
    "size": str,
    "adapters": str,
}


def _option(spec: Spec) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """One click option for a config setting: no click default (None means "not given", so the
    lower layers can fill it); the field's default shown in the help."""
    setting = spec.setting
    shown = setting.default_text or spec.default
    shown = ",".join(map(str, shown)) if isinstance(shown, tuple) else shown
    help_text = setting.help + ("" if shown is None else f"  [default: {shown}]")
    if setting.kind == "bool":
        name = spec.flag.removeprefix("--")
        return click.option(f"{spec.flag}/--no-{name}", spec.name, default=None, help=help_text)
    kind = click.Choice(setting.choices) if setting.choices else _CLICK_TYPES[setting.kind]
    if setting.kind == "adapters":  # repeatable; none given is "not given", for the lower layers
        return click.option(
            spec.flag,
            spec.name,
            type=kind,
            multiple=True,
            callback=lambda _c, _p, v: v or None,
            help=help_text,
        )
    return click.option(spec.flag, spec.name, type=kind, default=None, help=help_text)


def settings_options(settings: tuple[Spec, ...]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator adding one option per config setting, in the config's order."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        for spec in reversed(settings):
            command = _option(spec)(command)
        return command

    return decorate
