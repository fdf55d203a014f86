"""One generation request as it travels on a request stream, and the routing rule by length."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from tokenfleet.protocol.constants import (
    DEFAULT_LANE,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_REPLY_TTL_S,
    LANES,
    PROTOCOL_VERSION,
)


@dataclass(frozen=True)
class Request:
    """A validated request (see :func:`tokenfleet.protocol.validate_request`)."""

    id: str
    prompt: str | None = None
    input_ids: tuple[int, ...] | None = None
    # chat: ((role, content), ...), rendered by the worker with the model's chat template
    messages: tuple[tuple[str, str], ...] | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    deadline_ms: int | None = None
    reply_ttl_s: int = DEFAULT_REPLY_TTL_S
    # when Redis first accepted it (Unix ms), set by the worker that moves an ``auto`` entry to
    # its bucket: the queue time and the max_wait_ms window count from there, not from the move
    enqueued_ms: int | None = None
    priority: str = DEFAULT_LANE  # one of LANES
    v: int = PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def lane(self) -> int:
        """The lane's rank: 0 is the highest."""
        return LANES.index(self.priority)

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-ready map of this request, without defaults' noise."""
        # the fields are flat: no deep copy (``asdict`` made one per prompt token)
        values = ((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "extra")
        body = {k: v for k, v in values if v is not None}
        for k in ("input_ids", "stop", "stop_token_ids"):
            if k in body:
                body[k] = list(body[k])
        if self.messages is not None:
            body["messages"] = [{"role": role, "content": content} for role, content in self.messages]
        if not body["stop"]:
            del body["stop"]
        if not body["stop_token_ids"]:
            del body["stop_token_ids"]
        if body["priority"] == DEFAULT_LANE:  # older workers need not see it
            del body["priority"]
        return body


def smallest_bucket(buckets: Iterable[int], prompt_len: int) -> int | None:
    """The smallest bucket that holds ``prompt_len`` tokens, or None if every bucket is shorter:
    the one routing rule, shared by producers, the ``auto`` stream and the worker's admission."""
    return min((b for b in buckets if prompt_len <= b), default=None)
