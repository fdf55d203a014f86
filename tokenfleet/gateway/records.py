"""What a gateway replica keeps in Redis for the others: each completion's record (so any replica
resumes a dropped stream or replays a finished request) and what each Idempotency-Key stands for."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from tokenfleet.producer.openai.format import Completion
from tokenfleet.protocol import DEFAULT_REPLY_TTL_S, Keys


class Records:
    def __init__(self, redis: Any, keys: Keys, idempotency_ttl_s: int):
        self.redis = redis
        self.keys = keys
        self.idempotency_ttl_s = idempotency_ttl_s

    async def save(self, completion: Completion, ttl_s: int = DEFAULT_REPLY_TTL_S) -> None:
        """Keep ``completion``'s record as long as its replies."""
        await self.redis.set(self.keys.completion(completion.id), _dump(completion), ex=ttl_s)

    async def load(self, completion_id: str) -> Completion | None:
        raw = await self.redis.get(self.keys.completion(completion_id))
        return None if raw is None else Completion(**json.loads(raw))

    async def claim(self, idempotency_key: str, completion: Completion) -> Completion | None:
        """Make ``idempotency_key`` stand for ``completion``, unless it already stands for another:
        then that one (a retried POST attaches to it instead of generating again)."""
        digest = hashlib.sha256(idempotency_key.encode()).hexdigest()
        key = self.keys.idempotency(digest)
        if await self.redis.set(key, _dump(completion), nx=True, ex=self.idempotency_ttl_s):
            return None
        raw = await self.redis.get(key)
        return None if raw is None else Completion(**json.loads(raw))

    async def release(self, idempotency_key: str) -> None:
        """Forget a key whose completion could not be submitted (a retry may try again)."""
        digest = hashlib.sha256(idempotency_key.encode()).hexdigest()
        await self.redis.delete(self.keys.idempotency(digest))


def _dump(completion: Completion) -> str:
    return json.dumps(dataclasses.asdict(completion))
