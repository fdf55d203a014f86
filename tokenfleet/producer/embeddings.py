"""What the clients' ``embed`` shares: its inputs as ``submit`` calls, the ``embed`` spec, and the
vectors taken from the results."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from tokenfleet.errors import RequestFailed
from tokenfleet.producer.result import Result
from tokenfleet.protocol import ErrorCode


def embed_inputs(
    inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
) -> list[dict[str, Any]]:
    """``submit`` arguments for each input of :meth:`Client.embed`: texts, or token id lists (one
    text or one id list alone is one input)."""
    alone = isinstance(inputs, str) or (inputs and isinstance(inputs[0], int))
    items: list[Any] = [inputs] if alone else list(inputs)
    calls: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            calls.append({"prompt": item})
        elif isinstance(item, Sequence) and all(isinstance(t, int) for t in item):
            calls.append({"input_ids": list(item)})
        else:
            raise TypeError(f"embed takes texts or lists of token ids, got a {type(item).__name__}")
    return calls


def embed_spec(
    dimensions: int | None, normalize: bool | None, truncate: bool, pooling: str | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"truncate": truncate}
    if pooling is not None:
        spec["pooling"] = pooling
    if dimensions is not None:
        spec["dimensions"] = dimensions
    if normalize is not None:
        spec["normalize"] = normalize
    return spec


def vector_or_raise(result: Result) -> array[float]:
    if result.embedding is None and result.finish_reason == "cancelled":
        raise RequestFailed(result.id, "cancelled", "the request was cancelled")
    if result.embedding is None:  # a worker that answered with text: not an embedding fleet
        raise RequestFailed(result.id, ErrorCode.INTERNAL, "the reply carried no embedding")
    return result.embedding
