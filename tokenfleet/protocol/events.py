"""Reply events, typed: ``token`` events, then exactly one terminal ``done`` or ``error``.

On the wire a reply event is a stream entry with a plain ``type`` field and an ``m`` field holding
a msgpack map. Events sit at fixed stream ids (token ``i`` at ``0-{i+1}``, the terminal event at
``1-0``) so that Redis itself refuses a second copy of any event: a retried write, a redelivered
request or a second worker racing on the same request can never duplicate a token or an ending.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from tokenfleet.errors import ProtocolError
from tokenfleet.protocol.codec import Fields, pack, unpack
from tokenfleet.protocol.constants import BODY_FIELD, ErrorCode, EventType
from tokenfleet.protocol.embed import vector_of

TERMINAL_EVENT_ID = "1-0"
"""Stream id of every terminal event (see the module's note)."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log probability and the ``top`` most likely tokens at its position
    (token id, log probability), most likely first, from the distribution it was drawn from."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"logprob": self.logprob, "top": [[token, lp] for token, lp in self.top]}

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> TokenLogprob:
        return cls(float(body["logprob"]), [(int(t), float(lp)) for t, lp in body.get("top") or []])


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Tokens ``ids`` starting at position ``index`` among the generated tokens, and the text
    they completed (may be empty: a character or a stop string may still be forming); with
    ``logprobs`` (one per id) when the request asked for them."""

    type: ClassVar[str] = EventType.TOKEN
    terminal: ClassVar[bool] = False
    index: int
    ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None

    @property
    def stream_id(self) -> str:
        return f"0-{self.index + 1}"

    def to_wire(self) -> dict[str, Any]:
        body = {"type": self.type, "index": self.index, "ids": self.ids, "text": self.text}
        if self.logprobs is not None:
            body["logprobs"] = [lp.to_wire() for lp in self.logprobs]
        return body


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """The request ended normally: why, its token counts, timings (ms since it was enqueued:
    ``queue_ms``, ``ttft_ms``, ``total_ms``) and the batch it ran in; an embedding request's
    vector as little-endian float32 bytes in ``embedding``. ``cached_tokens``: prompt tokens whose
    K/V the prefix cache held when it started; ``stop``: the stop string that ended it, if one did.
    """

    type: ClassVar[str] = EventType.DONE
    terminal: ClassVar[bool] = True
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    batch_size: int = 0
    mean_batch_size: float | None = None
    worker: str | None = None
    embedding: bytes | None = None
    cached_tokens: int = 0
    stop: str | None = None

    @property
    def stream_id(self) -> str:
        return TERMINAL_EVENT_ID

    def vector(self) -> list[float]:
        """The embedding as Python floats (numpy: ``np.frombuffer(event.embedding, "<f4")``)."""
        return vector_of(self.embedding or b"").tolist()

    @property
    def usage(self) -> dict[str, int]:
        counts = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        return {**counts, "cached_tokens": self.cached_tokens} if self.cached_tokens else counts

    def to_wire(self) -> dict[str, Any]:
        body = {
            "type": self.type,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "timings": self.timings,
            "batch_size": self.batch_size,
        }
        if self.mean_batch_size is not None:
            body["mean_batch_size"] = self.mean_batch_size
        if self.worker is not None:
            body["worker"] = self.worker
        if self.embedding is not None:
            body["embedding"] = self.embedding
        if self.stop is not None:
            body["stop"] = self.stop
        return body


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The request failed: a stable :class:`~tokenfleet.protocol.ErrorCode` and a message."""

    type: ClassVar[str] = EventType.ERROR
    terminal: ClassVar[bool] = True
    code: str
    message: str

    @property
    def stream_id(self) -> str:
        return TERMINAL_EVENT_ID

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "code": self.code, "message": self.message}


ReplyEvent = TokenEvent | DoneEvent | ErrorEvent


def encode_event(event: ReplyEvent) -> Fields:
    return {b"type": event.type.encode(), BODY_FIELD: pack(event.to_wire())}


def decode_event(fields: Fields) -> ReplyEvent | None:
    """A reply entry as its typed event; None for a type this release does not know (newer
    workers may add some: readers skip them). Raises :class:`ProtocolError` on a malformed one."""
    try:
        body = unpack(fields[BODY_FIELD])
        kind = body["type"]
        if kind == EventType.TOKEN:
            logprobs = body.get("logprobs")
            return TokenEvent(
                int(body["index"]),
                list(body["ids"]),
                str(body.get("text", "")),
                None if logprobs is None else [TokenLogprob.from_wire(lp) for lp in logprobs],
            )
        if kind == EventType.DONE:
            usage = body.get("usage") or {}
            return DoneEvent(
                finish_reason=body["finish_reason"],
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                completion_tokens=int(usage.get("completion_tokens", 0)),
                timings=dict(body.get("timings") or {}),
                batch_size=int(body.get("batch_size") or 0),
                mean_batch_size=body.get("mean_batch_size"),
                worker=body.get("worker"),
                embedding=_embedding(body.get("embedding")),
                cached_tokens=int(usage.get("cached_tokens", 0)),
                stop=None if body.get("stop") is None else str(body["stop"]),
            )
        if kind == EventType.ERROR:
            return ErrorEvent(str(body.get("code", "unknown")), str(body.get("message", "")))
        return None
    except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as e:
        raise ProtocolError(ErrorCode.UNDECODABLE, f"malformed reply event: {e!r}") from e


def _embedding(value: Any) -> bytes | None:
    if value is not None and (not isinstance(value, bytes) or len(value) % 4):
        raise ValueError("embedding must be float32 bytes")
    return value


def is_duplicate_event_error(error: Exception) -> bool:
    """Whether Redis refused an XADD because that event id is already on the stream."""
    return "equal or smaller than the target stream top item" in str(error)
