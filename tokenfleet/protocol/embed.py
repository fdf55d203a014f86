"""The ``embed`` field of a request: ask for the prompt's vector instead of generated text.

An embedding request runs one forward pass over its prompt and ends with a ``done`` event whose
``embedding`` holds the vector as little-endian float32 bytes (4 bytes per dimension): compact on
the wire, read by numpy's ``frombuffer`` or any language's float reader.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import Any

from tokenfleet.protocol.constants import MAX_EMBED_DIMENSIONS

POOLINGS = ("mean", "last")
"""Poolings a generation model's worker offers (an embedding model pools as its config says)."""


@dataclass(frozen=True)
class EmbedSpec:
    """How to make the vector: ``dimensions`` keeps the first ones, then normalises again (for
    models trained for it, as Matryoshka models are); ``normalize`` to unit length (None: as the
    model's config says); ``pooling`` (generation models: mean or last token; None: the model's
    own, mean for a generation model); ``truncate`` inputs longer than the model takes to its
    length, as sentence-transformers does (False: such an input is refused)."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling: str | None = None
    truncate: bool = True

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if self.dimensions is not None:
            body["dimensions"] = self.dimensions
        if self.normalize is not None:
            body["normalize"] = self.normalize
        if self.pooling is not None:
            body["pooling"] = self.pooling
        if not self.truncate:
            body["truncate"] = False
        return body


def parse_embed(value: Any) -> EmbedSpec:
    """An ``embed`` map (``{}`` for the model's defaults) as an :class:`EmbedSpec`; raises
    ``ValueError`` naming what is wrong."""
    if value is True:  # the plain form's shorthand: ``embed true``
        return EmbedSpec()
    if not isinstance(value, dict):
        raise ValueError("embed must be a map (dimensions, normalize, pooling, truncate)")
    unknown = sorted(set(value) - {"dimensions", "normalize", "pooling", "truncate"})
    if unknown:
        raise ValueError(f"embed has unknown field {unknown[0]!r}")
    dims = value.get("dimensions")
    if dims is not None and (type(dims) is not int or not 0 < dims <= MAX_EMBED_DIMENSIONS):
        raise ValueError(f"embed.dimensions must be an integer in [1, {MAX_EMBED_DIMENSIONS}]")
    for flag in ("normalize", "truncate"):
        if value.get(flag) is not None and not isinstance(value[flag], bool):
            raise ValueError(f"embed.{flag} must be a boolean")
    pooling = value.get("pooling")
    if pooling is not None and pooling not in POOLINGS:
        raise ValueError(f"embed.pooling must be one of {', '.join(POOLINGS)}")
    truncate = value.get("truncate")
    return EmbedSpec(dims, value.get("normalize"), pooling, True if truncate is None else truncate)


def vector_of(data: bytes) -> array[float]:
    """An ``embedding``'s bytes as an ``array('f')``: numpy takes it without a copy
    (``np.frombuffer(v, np.float32)``, or ``np.asarray(vectors)`` for a list of them)."""
    values = array("f", data)
    if sys.byteorder == "big":  # the wire is little-endian
        values.byteswap()
    return values
