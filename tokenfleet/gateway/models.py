"""The models the gateway serves: the base models live workers serve (from their heartbeats) and
the LoRA adapters of the fleet's registry (``{P}:adapters``), as vLLM serves them: a request's
``model`` may name an adapter (its base must be served), ``/v1/models`` lists adapters with their
base as ``parent``, and ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` add and remove
them at run time (every worker of the base serves them, no restart), for an admin key only (they
point workers at directories on their disks). Both are looked up at most every few seconds."""

from __future__ import annotations

import hmac
import time
from typing import Any

import redis
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict
from redis.exceptions import NoPermissionError, OutOfMemoryError

from tokenfleet.errors import ProtocolError
from tokenfleet.gateway.errors import APIError, api_error
from tokenfleet.protocol import Keys, parse_heartbeat
from tokenfleet.protocol.adapters import AdapterRecord, check_adapter_name
from tokenfleet.transport.server.memory import out_of_memory

CACHE_S = 2.0
router = APIRouter()


class Fleet:
    def __init__(self, redis: Any, keys: Keys):
        self.redis = redis
        self.keys = keys
        self._models: dict[str, int] = {}  # served name -> live workers
        self._embedding: set[str] = set()  # served names whose workers embed
        self._known: set[str] = set()  # names any heartbeat still in Redis carries, live or not
        self._at = float("-inf")
        self._full, self._full_at = False, float("-inf")

    async def models(self) -> dict[str, int]:
        """Served model name -> how many live workers serve it."""
        if time.monotonic() - self._at > CACHE_S:
            now, models, known, embedding = time.time(), dict[str, int](), set(), set()
            for worker, raw in (await self.redis.hgetall(self.keys.workers)).items():
                beat = parse_heartbeat(worker, raw, now)
                if beat is None:
                    continue
                name = str(beat.get("model", "unknown"))
                known.add(name)
                if beat["alive"]:
                    models[name] = models.get(name, 0) + 1
                    if beat.get("task") == "embed":
                        embedding.add(name)
            self._models, self._known, self._at = models, known, time.monotonic()
            self._embedding = embedding
        return self._models

    async def embeds(self, model: str) -> bool:
        """Whether ``model``'s live workers serve an embedding model."""
        await self.models()
        return model in self._embedding

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


class Adapters:
    """The fleet's adapter registry as the gateway reads it (a moment's cache)."""

    def __init__(self, redis: Any, keys: Keys):
        self.redis, self.keys = redis, keys
        self._records: dict[str, AdapterRecord] = {}
        self._at = float("-inf")

    async def records(self) -> dict[str, AdapterRecord]:
        if time.monotonic() - self._at > CACHE_S:
            records = {}
            for name, raw in (await self.redis.hgetall(self.keys.adapters)).items():
                try:
                    records[name.decode()] = AdapterRecord.from_json(name.decode(), raw)
                except ProtocolError:
                    continue  # a bad record: its adapter is unknown here
            self._records, self._at = records, time.monotonic()
        return self._records

    async def add(self, record: AdapterRecord) -> None:
        try:
            await self.redis.hset(self.keys.adapters, record.name, record.to_json())
        except NoPermissionError as e:
            raise self._not_allowed() from e
        self._at = float("-inf")

    async def remove(self, name: str) -> bool:
        self._at = float("-inf")
        try:
            return bool(await self.redis.hdel(self.keys.adapters, name))
        except NoPermissionError as e:
            raise self._not_allowed() from e

    def _not_allowed(self) -> APIError:
        message = (
            f"the gateway's Redis user may not write the adapter registry ({self.keys.adapters}): "
            "add adapters with `tokenfleet lora add` as an admin, or let the gateway's user write that key"
        )
        return APIError(403, message, "permission_error", "permission_denied")


def require_admin(request: Request) -> None:
    """403 unless the request carries one of the gateway's admin keys (--admin-keys)."""
    admins = request.app.state.service.config.admins
    if not admins:
        message = "changing the fleet's adapters needs an admin key: start the gateway with --admin-keys"
        raise APIError(403, message, "permission_error", "permission_denied")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    given_bytes = given.strip().encode()  # compare_digest refuses str beyond ASCII
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(given_bytes, k.encode()) for k in admins):
        raise APIError(403, "this endpoint needs an admin key", "permission_error", "permission_denied")


async def resolve(service: Any, model: str) -> tuple[str, str | None]:
    """The model to require live workers for, and the adapter a request for ``model`` names
    (None: ``model`` is a base model)."""
    served = await service.fleet.models()
    if model in served:
        return model, None
    record = (await service.adapters.records()).get(model)
    if record is None:
        return model, None  # Fleet.require answers an unknown model
    if record.base is None:  # any model the fleet serves: the only one, if there is one
        return (next(iter(served)) if len(served) == 1 else model), model
    return record.base, model


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    base_model_name: str | None = None  # tokenfleet's: which base (default: the one served)
    load_inplace: bool = False


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter", response_model=None)
async def load_lora_adapter(body: LoadLoraAdapter, request: Request) -> PlainTextResponse:
    require_admin(request)
    service = request.app.state.service
    try:
        check_adapter_name(body.lora_name)
    except ValueError as e:
        raise APIError(400, str(e), param="lora_name") from e
    if body.load_inplace:  # workers hold an adapter by its name: new weights take a new name
        message = "load_inplace is not supported: load the new weights under a new lora_name"
        raise APIError(400, message, param="load_inplace")
    known = await service.adapters.records()
    if body.lora_name in known:
        message = f"the adapter {body.lora_name!r} is loaded already (new weights take a new lora_name)"
        raise APIError(400, message, param="lora_name")
    served = await service.fleet.models()
    base = body.base_model_name or (next(iter(served)) if len(served) == 1 else None)
    if base is None:
        raise APIError(
            400, "several models are served: name the adapter's base_model_name", param="base_model_name"
        )
    if body.lora_name in served:
        raise APIError(400, f"{body.lora_name!r} names a served model", param="lora_name")
    await service.adapters.add(AdapterRecord(body.lora_name, body.lora_path, base))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_model=None)
async def unload_lora_adapter(body: UnloadLoraAdapter, request: Request) -> PlainTextResponse:
    require_admin(request)
    if not await request.app.state.service.adapters.remove(body.lora_name):
        message = f"the adapter {body.lora_name!r} is not loaded"
        raise APIError(404, message, "not_found_error", "not_found", "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
