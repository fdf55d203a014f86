"""What a caller gets back: streamed chunks and the final result, folded from reply events."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from tokenfleet.errors import RequestFailed
from tokenfleet.protocol import ErrorEvent, ReplyEvent, TokenEvent, TokenLogprob
from tokenfleet.protocol.embed import vector_of


@dataclass(frozen=True)
class Chunk:
    """One ``token`` event: new token ids and the text they completed (may be empty)."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token id, where the request asked

    def __str__(self) -> str:
        return self.text


@dataclass
class Result:
    """A finished request."""

    id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop: str | None = None  # the stop string that ended it, if one did
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    batch_size: int | None = None
    worker: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, where the request asked
    embedding: array[float] | None = None  # an embedding request's vector, float32 (numpy takes it as is)


class ResultBuilder:
    """Folds reply events, in stream order, into chunks and a :class:`Result`.

    Token events carry their index: an event whose tokens were already seen (a redelivered
    request's retry) is skipped, so a caller never sees a token twice.
    """

    def __init__(self, request_id: str):
        self.result = Result(id=request_id)
        self._texts: list[str] = []
        self.finished = False

    def add(self, event: ReplyEvent) -> Chunk | None:
        """Fold one event; returns the chunk to show for a token event. Raises
        :class:`RequestFailed` on an ``error`` event."""
        if isinstance(event, TokenEvent):
            have = len(self.result.token_ids)
            if event.index + len(event.ids) <= have:
                return None
            skip = max(0, have - event.index)
            ids = event.ids[skip:]
            logprobs = event.logprobs[skip:] if event.logprobs is not None else None
            self.result.token_ids.extend(ids)
            if logprobs is not None:
                self.result.logprobs = (self.result.logprobs or []) + logprobs
            self._texts.append(event.text)
            return Chunk(index=max(event.index, have), token_ids=ids, text=event.text, logprobs=logprobs)
        self.finished = True
        if isinstance(event, ErrorEvent):
            raise RequestFailed(self.result.id, event.code, event.message)
        r = self.result
        r.text = "".join(self._texts)
        r.finish_reason, r.usage, r.timings = event.finish_reason, event.usage, event.timings
        r.batch_size, r.worker, r.stop = event.batch_size, event.worker, event.stop
        if event.embedding is not None:
            r.embedding = vector_of(event.embedding)
        return None
