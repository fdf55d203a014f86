"""Background responses followed to their end, so that each raises its webhook event even when
nobody retrieves it: a replica leases open responses (``{P}:responses:open``) and renews the
leases while it follows them; when it dies, another takes them over when the leases lapse."""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Any

import redis

import tokenfleet.gateway.completions as completions
from tokenfleet.errors import RequestFailed, ResultTimeout
from tokenfleet.gateway.responses.store import Stored
from tokenfleet.gateway.service import Service
from tokenfleet.gateway.webhooks.events import RESPONSE_ENDINGS
from tokenfleet.gateway.webhooks.outbox import Outbox
from tokenfleet.protocol import ErrorCode, ErrorEvent
from tokenfleet.protocol.codec import as_text
from tokenfleet.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
POLL_S = 1.0
LEASE_S = 30.0
DEADLINE_GRACE_S = 60.0  # past the deadline the worker itself ends it: give it time to say so


async def open_response(service: Service, response_id: str) -> None:
    """Have some replica follow this background response to its end (due now)."""
    await service.client.redis.zadd(service.client.keys.open_responses, {response_id: 0})


async def watch_forever(service: Service) -> None:
    """Lease open responses, follow each to its end, renew the leases held; until cancelled."""
    outbox, warn = Outbox(service.client.redis, service.client.keys), RateLimitedLog(log)
    following: dict[str, asyncio.Task[None]] = {}
    try:
        await _watch(service, outbox, warn, following)
    finally:  # the gateway stops: its leases lapse, another replica follows these
        for task in list(following.values()):
            task.cancel()


async def _watch(
    service: Service, outbox: Outbox, warn: RateLimitedLog, following: dict[str, asyncio.Task[None]]
) -> None:
    client, keys = service.client.redis, service.client.keys
    while True:
        try:
            for member in await outbox.lease(keys.open_responses, LEASE_S, 64):
                response_id = as_text(member)
                if response_id not in following:
                    following[response_id] = asyncio.create_task(_follow(service, outbox, response_id))
                    following[response_id].add_done_callback(partial(_forget, following, response_id))
            if following:
                renewed = {response_id: time.time() + LEASE_S for response_id in following}
                await client.zadd(keys.open_responses, renewed, xx=True)
        except redis.RedisError as e:
            warn.log(logging.WARNING, "redis", "background responses: %s; retrying", e)
        except Exception:  # a bug must not end the watch on this replica
            warn.log(logging.ERROR, "bug", "following background responses failed", exc_info=True)
        await asyncio.sleep(POLL_S)


def _forget(following: dict[str, asyncio.Task[None]], response_id: str, _: object) -> None:
    following.pop(response_id, None)


async def _follow(service: Service, outbox: Outbox, response_id: str) -> None:
    keys = service.client.keys
    try:
        stored = await service.responses.load(response_id)
        if stored is None:  # deleted
            await service.client.redis.zrem(keys.open_responses, response_id)
            return
        response = stored.final or await _to_the_end(service, stored)
        if await service.responses.finish(response_id, response):  # not deleted meanwhile
            await outbox.emit(RESPONSE_ENDINGS[response["status"]], response_id)
        await service.client.redis.zrem(keys.open_responses, response_id)
    except redis.RedisError as e:  # the lease lapses: this replica or another follows it again
        log.warning("following background response %s: %s", response_id, e)
    except Exception:  # a bug: logged; the lease lapses and it is tried again
        log.error("following background response %s failed", response_id, exc_info=True)


async def _to_the_end(service: Service, stored: Stored) -> dict[str, Any]:
    """The response once it ends: its reply stream's terminal event, or failed once it is past
    its deadline with none (no worker ever took it, or Redis lost its reply)."""
    record = stored.record
    fold = record.fold()
    left = record.created_at + background_deadline_s(service) + DEADLINE_GRACE_S - time.time()
    try:
        async for event in service.client.events(record.completion.request_id(0), max(left, 1.0)):
            fold.fold(event)
    except RequestFailed as e:  # Redis lost the reply
        fold.fold(ErrorEvent(e.code, e.message))
    except ResultTimeout:
        await completions.cancel(service, record.completion)  # a worker that comes later skips it
        fold.fold(ErrorEvent(ErrorCode.DEADLINE_EXCEEDED, "the background response did not end in time"))
    return fold.snapshot(stored.cancelled)


def background_deadline_s(service: Service) -> float:
    """How long a background response may wait and run: as long as it is kept."""
    return float(service.config.responses_ttl_s)
