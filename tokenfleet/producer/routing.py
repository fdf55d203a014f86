"""Everything a producer decides before the XADD: the request, its tokens, its stream.

Shared by the sync and asyncio clients. The tokenizer is the ``tokenizers`` library reading the
model's ``tokenizer.json`` (no transformers, no torch, no weights).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from redis.exceptions import OutOfMemoryError

from tokenfleet import protocol
from tokenfleet.errors import QueueFull, RedisFull, ResultTimeout
from tokenfleet.protocol import Keys, Request, ResponseFormat
from tokenfleet.protocol.affinity import shard_of
from tokenfleet.protocol.embed import EmbedSpec, parse_embed
from tokenfleet.protocol.output_controls import parse_logit_bias, parse_response_format

READ_BLOCK_MS = 1000  # longest single XREAD wait while following a reply stream


def load_tokenizer(model: str | None) -> Any | None:
    """The fast tokenizer of a local model directory, or None when no model is given or it has no
    ``tokenizer.json`` (the request then goes to the ``auto`` stream and a worker tokenizes)."""
    if model is None:
        return None
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def new_request_id() -> str:
    return uuid.uuid4().hex


def build_request(
    prompt: str | None,
    input_ids: list[int] | None,
    tokenizer: Any | None,
    request_id: str | None,
    params: dict[str, Any],
) -> Request:
    """A :class:`Request` carrying token ids whenever they can be known here (chat messages are
    rendered by a worker, with the model's template)."""
    messages = params.pop("messages", None)
    if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
        raise ValueError("give exactly one of prompt, input_ids and messages")
    if messages is not None:
        params["messages"] = tuple((m["role"], m["content"]) for m in messages)
    if params.get("embed") is not None:  # the worker tokenizes an embedding's text as its model does
        params["embed"] = embed_spec_of(params["embed"])
    elif prompt is not None and tokenizer is not None:
        input_ids = tokenizer.encode(prompt).ids
        prompt = None
    if params.get("response_format") is not None:
        params["response_format"] = response_format_of(params["response_format"])
    if params.get("logit_bias") is not None:
        params["logit_bias"] = parse_logit_bias(dict(params["logit_bias"]))
    for name in ("stop", "stop_token_ids"):
        if isinstance(params.get(name), str):
            params[name] = (params[name],)
        elif params.get(name) is not None:
            params[name] = tuple(params[name])
    return Request(
        id=request_id or new_request_id(),
        prompt=prompt,
        input_ids=tuple(input_ids) if input_ids is not None else None,
        **params,
    )


def embed_spec_of(value: Any) -> EmbedSpec:
    """An ``embed`` from an :class:`EmbedSpec`, a map of its fields, or ``True`` (the model's defaults)."""
    return value if isinstance(value, EmbedSpec) else parse_embed({} if value is True else value)


def response_format_of(value: Any) -> ResponseFormat | None:
    """A ``response_format`` from what a caller has at hand: a :class:`ResponseFormat`, a pydantic
    model class (its JSON schema, named after it), or OpenAI's map (``{"type": "json_schema",
    "json_schema": {"schema": ...}}``, ``{"type": "json_object"}``, ours ``regex`` / ``grammar``)."""
    if isinstance(value, ResponseFormat):
        return value
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        spec = {"name": value.__name__, "schema": value.model_json_schema()}
        return parse_response_format({"type": "json_schema", "json_schema": spec})
    return parse_response_format(value)


def target_stream(keys: Keys, request: Request, buckets: list[int], length: int | None = None) -> str:
    """The stream a request goes to, in its lane: the affinity shard (docs/PROTOCOL.md) of the
    smallest served bucket that holds its tokens (``length``: their count where the request
    carries text); ``auto`` when its length is unknown here or no worker has announced buckets.
    Too long for every bucket: the largest, so that a worker answers with a clear
    ``prompt_too_long`` (or, for an embedding, truncates it)."""
    lane = request.priority
    n = len(request.input_ids) if request.input_ids is not None else length
    if n is None or not buckets:
        return keys.auto_stream_of(lane)
    bucket = protocol.smallest_bucket(buckets, n) or max(buckets)
    return keys.shard_stream(bucket, lane, shard_of(request.to_wire()))


def next_block_ms(request_id: str, deadline: float | None, timeout: float | None) -> int:
    """How long the next XREAD on a reply stream may block; raises :class:`ResultTimeout` once
    ``deadline`` (a ``time.monotonic()`` value) has passed."""
    if deadline is None:
        return READ_BLOCK_MS
    left = deadline - time.monotonic()
    if left <= 0:
        raise result_timeout(request_id, timeout)
    return max(1, min(READ_BLOCK_MS, int(left * 1000)))


def result_timeout(request_id: str, timeout: float | None) -> ResultTimeout:
    return ResultTimeout(f"no terminal event for request {request_id} within {timeout}s")


def queue_full_error(error: Exception) -> QueueFull | RedisFull | None:
    """The :class:`QueueFull` that an ENQUEUE_SCRIPT refusal stands for, the :class:`RedisFull`
    of a Redis out of memory (under MULTI: the transaction aborted for it), or None."""
    text = str(error)
    if text.startswith("QUEUEFULL"):
        return QueueFull(text.removeprefix("QUEUEFULL "))
    if isinstance(error, OutOfMemoryError) or "used memory > 'maxmemory'" in text:
        return RedisFull(
            "Redis is out of memory (maxmemory reached under noeviction): the request was not queued; "
            "free memory or raise maxmemory"
        )
    return None


def enqueue_args(keys: Keys, stream: str, request: Request) -> tuple[list[str], list]:
    """KEYS and ARGV of :data:`~tokenfleet.transport.scripts.ENQUEUE` for one request: the stream,
    the limits hash and every stream of its queue (whose waiting entries count together); the
    queue's field in the hash (``128``, ``128:batch``) and the body."""
    body = request.to_wire()
    bucket = stream.split(":req:", 1)[1].split(":", 1)[0]
    name = keys.queue_name(bucket, request.priority)
    siblings = keys.queue_streams(int(bucket) if bucket.isdigit() else bucket, request.priority)
    return [stream, keys.max_queue, *siblings], [name, protocol.pack(body)]
