"""Which models live workers serve, from their heartbeats (looked up at most every few seconds)."""

from __future__ import annotations

import time
from typing import Any

import redis
from redis.exceptions import OutOfMemoryError

from tokenfleet.gateway.errors import APIError, api_error
from tokenfleet.protocol import Keys, parse_heartbeat
from tokenfleet.transport.server.memory import out_of_memory

CACHE_S = 2.0


class Fleet:
    def __init__(self, redis: Any, keys: Keys):
        self.redis = redis
        self.keys = keys
        self._models: dict[str, int] = {}  # served name -> live workers
        self._known: set[str] = set()  # names any heartbeat still in Redis carries, live or not
        self._at = float("-inf")
        self._full, self._full_at = False, float("-inf")

    async def models(self) -> dict[str, int]:
        """Served model name -> how many live workers serve it."""
        if time.monotonic() - self._at > CACHE_S:
            now, models, known = time.time(), dict[str, int](), set()
            for worker, raw in (await self.redis.hgetall(self.keys.workers)).items():
                beat = parse_heartbeat(worker, raw, now)
                if beat is None:
                    continue
                name = str(beat.get("model", "unknown"))
                known.add(name)
                if beat["alive"]:
                    models[name] = models.get(name, 0) + 1
            self._models, self._known, self._at = models, known, time.monotonic()
        return self._models

    async def redis_full(self) -> bool:
        """Whether Redis is out of memory (looked up at most every :data:`CACHE_S`): workers
        cannot write heartbeats then, so quiet ones are not gone."""
        if time.monotonic() - self._full_at > CACHE_S:
            try:
                info = await self.redis.info("memory")
            except redis.ResponseError:  # an ACL without INFO: no verdict
                info = {}
            self._full, self._full_at = out_of_memory(info), time.monotonic()
        return self._full

    async def require(self, model: str) -> None:
        """Raise unless a live worker serves ``model``: OpenAI's 404 ``model_not_found`` for a
        name no worker has served while others serve, a 503 (retried by OpenAI's clients) when
        no worker serves at all or this model's workers have all gone quiet."""
        models = await self.models()
        if model not in models and await self.redis_full():
            raise api_error(OutOfMemoryError())
        if model not in models:
            served = ", ".join(sorted(models)) or "none"
            if models and model not in self._known:
                raise APIError(
                    404,
                    f"the model {model!r} does not exist here (served now: {served})",
                    "invalid_request_error",
                    "model_not_found",
                    "model",
                )
            raise APIError(
                503,
                f"no live worker serves model {model!r} (served now: {served})",
                "api_error",
                "model_not_served",
                "model",
            )
