"""What a caller gets back: streamed chunks and the final result, folded from reply events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenfleet.errors import RequestFailed
from tokenfleet.protocol import EventType


@dataclass(frozen=True)
class Chunk:
    """One ``token`` event: new token ids and the text they completed (may be empty)."""

    index: int
    token_ids: list[int]
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass
class Result:
    """A finished request."""

    id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    batch_size: int | None = None
    worker: str | None = None


class ResultBuilder:
    """Folds reply events, in stream order, into chunks and a :class:`Result`.

    Token events carry their index: an event whose tokens were already seen (a redelivered
    request's retry) is skipped, so a caller never sees a token twice.
    """

    def __init__(self, request_id: str):
        self.result = Result(id=request_id)
        self._texts: list[str] = []
        self.finished = False

    def add(self, event: dict[str, Any]) -> Chunk | None:
        """Fold one event; returns the chunk to show for a token event. Raises
        :class:`RequestFailed` on an ``error`` event."""
        kind = event.get("type")
        if kind == EventType.TOKEN:
            index, ids = int(event["index"]), list(event["ids"])
            have = len(self.result.token_ids)
            if index + len(ids) <= have:
                return None
            ids = ids[have - index :] if index < have else ids
            self.result.token_ids.extend(ids)
            self._texts.append(event.get("text", ""))
            return Chunk(index=max(index, have), token_ids=ids, text=event.get("text", ""))
        if kind == EventType.DONE:
            self.finished = True
            self.result.text = "".join(self._texts)
            self.result.finish_reason = event.get("finish_reason")
            self.result.usage = event.get("usage", {})
            self.result.timings = event.get("timings", {})
            self.result.batch_size = event.get("batch_size")
            self.result.worker = event.get("worker")
            return None
        if kind == EventType.ERROR:
            self.finished = True
            raise RequestFailed(self.result.id, event.get("code", "unknown"), event.get("message", ""))
        return None  # unknown event types are for newer clients: skip
