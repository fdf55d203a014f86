"""Background responses followed to their end, so that each raises its webhook event even when
nobody retrieves it: a replica leases open responses (``{P}:responses:open``) and renews the
leases while it follows them; when it dies, another takes them over when the leases lapse."""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

import redis

from tokenfleet.errors import RequestFailed
from tokenfleet.gateway.service import Service
from tokenfleet.gateway.webhooks.events import RESPONSE_ENDINGS
from tokenfleet.gateway.webhooks.outbox import Outbox
from tokenfleet.protocol import ErrorEvent
from tokenfleet.protocol.codec import as_text
from tokenfleet.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
POLL_S = 1.0
LEASE_S = 30.0


async def open_response(service: Service, response_id: str) -> None:
    """Have some replica follow this background response to its end (due now)."""
    await service.client.redis.zadd(service.client.keys.open_responses, {response_id: 0})


async def watch_forever(service: Service) -> None:
    """Lease open responses, follow each to its end, renew the leases held; until cancelled."""
    client, keys = service.client.redis, service.client.keys
    outbox, warn = Outbox(client, keys), RateLimitedLog(log)
    following: dict[str, asyncio.Task[None]] = {}
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
        fold = stored.record.fold()
        try:
            async for event in service.client.events(stored.record.completion.request_id(0), None):
                fold.fold(event)
        except RequestFailed as e:  # Redis lost the reply: the response failed
            fold.fold(ErrorEvent(e.code, e.message))
        response = fold.snapshot()
        if await service.responses.finish(response_id, response):  # not deleted meanwhile
            await outbox.emit(RESPONSE_ENDINGS[response["status"]], response_id)
        await service.client.redis.zrem(keys.open_responses, response_id)
    except redis.RedisError as e:  # the lease lapses: this replica or another follows it again
        log.warning("following background response %s: %s", response_id, e)
