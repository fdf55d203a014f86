"""Which models live workers serve, from their heartbeats (looked up at most every few seconds)."""

from __future__ import annotations

import time
from typing import Any

from tokenfleet import protocol
from tokenfleet.gateway.errors import APIError
from tokenfleet.protocol import Keys
from tokenfleet.transport.registry import STALE_AFTER_S

CACHE_S = 2.0


class Fleet:
    def __init__(self, redis: Any, keys: Keys):
        self.redis = redis
        self.keys = keys
        self._models: dict[str, int] = {}  # served name -> live workers
        self._at = float("-inf")

    async def models(self) -> dict[str, int]:
        """Served model name -> how many live workers serve it."""
        if time.monotonic() - self._at > CACHE_S:
            now, models = time.time(), dict[str, int]()
            for raw in (await self.redis.hgetall(self.keys.workers)).values():
                try:
                    beat = protocol.unpack(raw)
                except ValueError:
                    continue
                if isinstance(beat, dict) and now - float(beat.get("seen", 0)) < STALE_AFTER_S:
                    name = str(beat.get("model", "unknown"))
                    models[name] = models.get(name, 0) + 1
            self._models, self._at = models, time.monotonic()
        return self._models

    async def require(self, model: str) -> None:
        """Raise a 503 unless a live worker serves ``model``."""
        models = await self.models()
        if model not in models:
            served = ", ".join(sorted(models)) or "none"
            raise APIError(
                503,
                f"no live worker serves model {model!r} (served now: {served})",
                "api_error",
                "model_not_served",
                "model",
            )
