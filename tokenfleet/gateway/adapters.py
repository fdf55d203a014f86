"""LoRA adapters at the gateway, as vLLM serves them: a request's ``model`` may name an adapter
(its base must be served), ``/v1/models`` lists adapters with their base as ``parent``, and
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` add and remove them at run time
(recorded in the fleet's registry in Redis, ``{P}:adapters``: every worker of the base serves
them, no restart)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tokenfleet.errors import ProtocolError
from tokenfleet.gateway.errors import APIError
from tokenfleet.protocol import Keys
from tokenfleet.protocol.adapters import AdapterRecord, check_adapter_name

CACHE_S = 2.0
router = APIRouter()


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
        await self.redis.hset(self.keys.adapters, record.name, record.to_json())
        self._at = float("-inf")

    async def remove(self, name: str) -> bool:
        self._at = float("-inf")
        return bool(await self.redis.hdel(self.keys.adapters, name))


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
    service = request.app.state.service
    try:
        check_adapter_name(body.lora_name)
    except ValueError as e:
        raise APIError(400, str(e), param="lora_name") from e
    known = await service.adapters.records()
    if body.lora_name in known and not body.load_inplace:
        message = f"the adapter {body.lora_name!r} is loaded already (load_inplace: true replaces it)"
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
    if not await request.app.state.service.adapters.remove(body.lora_name):
        message = f"the adapter {body.lora_name!r} is not loaded"
        raise APIError(404, message, "not_found_error", "not_found", "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
