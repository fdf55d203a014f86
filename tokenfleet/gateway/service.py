"""What every route of one gateway process shares: its settings, one asyncio client (one XREAD
for every reply stream it follows), the completion records and the view of the fleet.

The records are what a gateway replica keeps in Redis for the others: each completion's record (so
any replica resumes a dropped stream or replays a finished request) and what each Idempotency-Key
stands for."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import redis

from tokenfleet.config import GatewayConfig
from tokenfleet.gateway.models import Adapters, Fleet
from tokenfleet.gateway.responses.store import ResponseStore
from tokenfleet.producer import AsyncClient
from tokenfleet.producer.openai.format import Completion
from tokenfleet.protocol import DEFAULT_REPLY_TTL_S, Keys
from tokenfleet.transport.server.connection import connect_client


class Records:
    """Completion records and Idempotency-Keys in Redis (see the module's note)."""

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


@dataclass
class Service:
    config: GatewayConfig
    client: AsyncClient
    records: Records
    fleet: Fleet
    adapters: Adapters
    embed_client: AsyncClient  # /v1/embeddings' fleet (--embed-prefix): this client unless another
    embed_fleet: Fleet
    responses: ResponseStore

    @classmethod
    def start(cls, config: GatewayConfig) -> Service:
        client = AsyncClient(config.redis.url, model=config.model, prefix=config.redis.prefix)
        records = Records(client.redis, client.keys, config.idempotency_ttl_s)
        fleet, adapters = Fleet(client.redis, client.keys), Adapters(client.redis, client.keys)
        embed_client, embed_fleet = client, fleet
        other_prefix = config.embed_prefix not in (None, config.redis.prefix)
        if other_prefix or config.embed_model is not None:
            prefix = config.embed_prefix or config.redis.prefix
            embed_client = AsyncClient(config.redis.url, model=config.embed_model, prefix=prefix)
            embed_fleet = Fleet(embed_client.redis, embed_client.keys)
        responses = ResponseStore(client.redis, client.keys)
        return cls(config, client, records, fleet, adapters, embed_client, embed_fleet, responses)

    background: set[asyncio.Task[None]] = field(default_factory=set)
    _sync_redis: redis.Redis | None = None

    def sync_redis(self) -> redis.Redis:
        """A blocking client, for the rare route that runs Redis-side code on a thread."""
        if self._sync_redis is None:
            self._sync_redis = connect_client(self.config.redis.url)
        return self._sync_redis

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` after the response is gone (a task kept until it ends)."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def close(self) -> None:
        await self.client.close()
        if self.embed_client is not self.client:
            await self.embed_client.close()
        if self._sync_redis is not None:
            self._sync_redis.close()


def caller_fields(request: Any) -> dict[str, Any]:
    """Request fields an HTTP request gives: its trace context and its API key's tenant (set by
    the gateway's middleware)."""
    state = request.state
    fields = {"traceparent": getattr(state, "traceparent", None), "tenant": getattr(state, "tenant", None)}
    return {name: value for name, value in fields.items() if value is not None}
