"""Responses kept in Redis, so that any gateway replica retrieves, streams again, cancels or
continues (``previous_response_id``) a response another one created.

A response is a hash at ``{prefix}:response:{id}``: ``record`` (its body, the turns before it and
its chat completion, written once), ``cancelled`` (set by a cancel) and ``final`` (the response
object, written by whichever replica first sees it end: it outlives the reply stream's events
only in that it is smaller). The hash expires with the response's reply stream.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tokenfleet.producer.openai.format import Completion
from tokenfleet.producer.openai.response_output import ResponseFold
from tokenfleet.producer.openai.responses import Item
from tokenfleet.protocol import Keys


@dataclass(frozen=True)
class ResponseRecord:
    """What a response was asked: its body (``input`` as given), the items of the turns before
    it, its own input items (full form) and the chat completion that answers it."""

    id: str
    body: dict[str, Any]
    created_at: int
    history: list[Item]
    input: list[Item]
    completion: Completion

    def fold(self) -> ResponseFold:
        """A fold at the start of this response's reply stream."""
        return ResponseFold(self.id, self.body, self.created_at, self.completion)

    def dump(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def load(cls, raw: bytes | str) -> ResponseRecord:
        fields = json.loads(raw)
        return cls(**{**fields, "completion": Completion(**fields["completion"])})


@dataclass(frozen=True)
class Stored:
    """A response as Redis holds it."""

    record: ResponseRecord
    cancelled: bool
    final: dict[str, Any] | None


# a field set on a response that still exists: a cancel or an ending racing a delete must not
# leave a hash without a TTL behind
SET_IF_PRESENT = """
if redis.call('exists', KEYS[1]) == 0 then return 0 end
redis.call('hsetnx', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class ResponseStore:
    def __init__(self, redis: Any, keys: Keys):
        self.redis, self.keys = redis, keys
        self._set_if_present = redis.register_script(SET_IF_PRESENT)

    async def save(self, record: ResponseRecord, ttl_s: int) -> None:
        key = self.keys.response(record.id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, "record", record.dump())
        pipe.expire(key, ttl_s)
        await pipe.execute()

    async def load(self, response_id: str) -> Stored | None:
        raw = await self.redis.hmget(self.keys.response(response_id), "record", "cancelled", "final")
        if raw[0] is None:
            return None
        final = None if raw[2] is None else json.loads(raw[2])
        return Stored(ResponseRecord.load(raw[0]), raw[1] is not None, final)

    async def cancel(self, response_id: str) -> bool:
        """Mark a cancel asked; False where the response is gone."""
        key = self.keys.response(response_id)
        return bool(await self._set_if_present(keys=[key], args=["cancelled", "1"]))

    async def finish(self, response_id: str, response: dict[str, Any]) -> bool:
        """Keep the ended response's object, where it still exists (False after a delete)."""
        key = self.keys.response(response_id)
        return bool(await self._set_if_present(keys=[key], args=["final", json.dumps(response)]))

    async def delete(self, response_id: str) -> bool:
        return bool(await self.redis.delete(self.keys.response(response_id)))
