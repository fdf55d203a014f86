"""How a config field meets its users: its flag, its environment variable, its help and how text
becomes its value. Declared once, beside the field's default; the CLI's options, the environment,
the TOML file and the profiles all go through it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "TOKENFLEET_"


@dataclass(frozen=True)
class Setting:
    """A user-facing config field. ``kind``: int, float, bool, str, or ``buckets`` / ``size`` /
    ``path`` (a str with its own parsing or checks); ``choices`` limit a str."""

    help: str
    kind: str
    choices: tuple[str, ...] = ()
    flag: str | None = None  # default: the field's name
    env_aliases: tuple[str, ...] = ()  # read after TOKENFLEET_<FLAG>, e.g. REDIS_URL
    default_text: str | None = None  # what --help says the default is, where the field's is not it


def setting(
    default: Any,
    help: str,
    *,
    kind: str | None = None,
    choices: tuple[str, ...] = (),
    flag: str | None = None,
    env_aliases: tuple[str, ...] = (),
    default_text: str | None = None,
) -> Any:
    """A dataclass field with its :class:`Setting`; ``kind`` defaults to the default's type."""
    if kind is None:
        if default is None:
            raise TypeError("a setting whose default is None needs kind=")
        kind = "str" if choices else type(default).__name__
    meta = Setting(help, kind, choices, flag, env_aliases, default_text)
    return field(default=default, metadata={"setting": meta})


def section(cls: type) -> Any:
    """A nested config dataclass, defaulting to its own defaults."""
    return field(default_factory=cls, metadata={"section": cls})


@dataclass(frozen=True)
class Spec:
    """One flat setting of a nested config: where it lives and how it reads."""

    path: tuple[str, ...]  # attribute names from the root config
    name: str  # flag name with underscores: max_wait_ms
    setting: Setting
    default: Any

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> tuple[str, ...]:
        return (ENV_PREFIX + self.name.upper(), *self.setting.env_aliases)

    def parse(self, value: Any, source: str) -> Any:
        """``value`` from ``source`` (an environment variable, a file, a profile) as this field's
        type; ``ValueError`` naming the setting and the source otherwise."""
        try:
            return _PARSERS[self.setting.kind](value) if isinstance(value, str) else _typed(self, value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{self.name} from {source}: {e}") from e


def specs(cls: type, path: tuple[str, ...] = ()) -> Iterator[Spec]:
    """Every setting of ``cls`` and its sections, depth first, in declaration order."""
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            yield from specs(f.metadata["section"], (*path, f.name))
        elif "setting" in f.metadata:
            meta: Setting = f.metadata["setting"]
            yield Spec((*path, f.name), meta.flag or f.name, meta, f.default)


def build(cls: type, values: dict[str, Any], path: tuple[str, ...] = ()) -> Any:
    """An instance of ``cls`` with ``values`` (by flag name) in place of defaults."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            kwargs[f.name] = build(f.metadata["section"], values, (*path, f.name))
        elif "setting" in f.metadata:
            name = f.metadata["setting"].flag or f.name
            if name in values:
                kwargs[f.name] = values[name]
    return cls(**kwargs)


def flatten(config: Any) -> dict[str, Any]:
    """A config's settings by flag name (what ``--dry-run`` prints and a TOML file may hold)."""
    out = {}
    for spec in specs(type(config)):
        value = config
        for attr in spec.path:
            value = getattr(value, attr)
        out[spec.name] = list(value) if isinstance(value, tuple) else value
    return out


_INT_RE = re.compile(r"[-+]?[0-9]+")
_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6}
_UNITS |= {"mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_int(text: str) -> int:
    if not _INT_RE.fullmatch(text.strip()):
        raise ValueError(f"{text!r} is not an integer")
    return int(text)


def parse_bool(text: str) -> bool:
    try:
        return _BOOLS[text.strip().lower()]
    except KeyError:
        raise ValueError(f"{text!r} is not a boolean (true/false, 1/0, on/off)") from None


def parse_buckets(text: str) -> tuple[int, ...]:
    """``"128,256,512"`` as a sorted tuple, with a clear error on junk."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise ValueError(f"buckets must be comma-separated integers, got {text!r}") from e
    return tuple(sorted(set(values)))


def parse_adapters(value: str | list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``NAME=DIR`` items (a list, or one string of them comma-separated) as (name, dir) pairs."""
    items = [i for i in value.split(",")] if isinstance(value, str) else list(value)
    pairs = []
    for item in (i.strip() for i in items):
        name, sep, directory = item.partition("=")
        if not item:
            continue
        if not sep or not name.strip() or not directory.strip():
            raise ValueError(f"an adapter is NAME=DIR, got {item!r}")
        pairs.append((name.strip(), directory.strip()))
    return tuple(pairs)


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1000000"`` in bytes."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 512MiB or 2GiB")
    return int(float(num) * _UNITS[unit])


_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": parse_int,
    "float": float,
    "bool": parse_bool,
    "str": str,
    "path": str,
    "buckets": parse_buckets,
    "size": parse_size,
    "adapters": parse_adapters,
}


def _typed(spec: Spec, value: Any) -> Any:
    """A value that is already typed (a flag click converted, a TOML number or list)."""
    kind = spec.setting.kind
    if value is None:
        return None
    if kind == "buckets" and isinstance(value, (list, tuple)):
        return parse_buckets(",".join(map(str, value)))
    if kind == "adapters" and isinstance(value, (list, tuple)):
        return parse_adapters([str(v) if isinstance(v, str) else "=".join(v) for v in value])
    if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = {"int": int, "float": float, "bool": bool, "size": int, "buckets": tuple}.get(kind, str)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise TypeError(f"expected {kind}, got {type(value).__name__} {value!r}")
    return value
