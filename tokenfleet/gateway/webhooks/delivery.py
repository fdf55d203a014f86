"""Webhook delivery: every gateway replica with endpoints configured takes due events under a
lease and POSTs each, signed, to every endpoint that has not taken it yet; at least once, with
backoff, whatever replica dies (see ``outbox``). Redirects are not followed: an endpoint cannot
send the fleet on to an address the allowlist would refuse."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import redis

from tokenfleet.gateway.webhooks.events import signed_headers
from tokenfleet.gateway.webhooks.outbox import Outbox, endpoint_digest, settle
from tokenfleet.protocol import Keys
from tokenfleet.protocol.codec import as_text
from tokenfleet.ratelog import RateLimitedLog

log = logging.getLogger(__name__)
POLL_S = 0.5
TIMEOUT_S = 10.0  # per endpoint, the whole request
BATCH = 32


async def deliver_forever(
    client: Any, keys: Keys, endpoints: tuple[str, ...], key: bytes, count: Callable[[str], None]
) -> None:
    """Deliver due events until cancelled; ``count`` tallies each attempt's outcome."""
    outbox, warn = Outbox(client, keys), RateLimitedLog(log)
    lease_s = 2 * TIMEOUT_S * len(endpoints) + 30  # an attempt ends well within its lease
    async with httpx.AsyncClient(timeout=TIMEOUT_S, follow_redirects=False) as http:
        while True:
            due: list[Any] = []
            try:
                due = await outbox.lease(keys.webhooks_due, lease_s, BATCH)
                attempts = (deliver(http, client, keys, as_text(i), endpoints, key) for i in due)
                for outcome in await asyncio.gather(*attempts):
                    count(outcome)
            except redis.RedisError as e:  # Redis away: the leases lapse, the events stay due
                warn.log(logging.WARNING, "redis", "webhook delivery: %s; retrying", e)
            except Exception:  # a bug must not end delivery on this replica: the leases lapse
                warn.log(logging.ERROR, "bug", "webhook delivery failed; retrying", exc_info=True)
            if len(due) < BATCH:
                await asyncio.sleep(POLL_S)


async def deliver(
    http: httpx.AsyncClient, client: Any, keys: Keys, ident: str, endpoints: tuple[str, ...], key: bytes
) -> str:
    """One attempt at event ``ident``: ``delivered``, ``failed`` (retried later) or ``expired``."""
    fields = {as_text(k): v for k, v in (await client.hgetall(keys.webhook(ident))).items()}
    body = fields.get("body")
    if body is None:  # expired before any endpoint took it
        await client.zrem(keys.webhooks_due, ident)
        return "expired"
    failed = []
    for url in endpoints:
        digest = endpoint_digest(url)
        if f"ok:{digest}" in fields:
            continue
        headers = signed_headers(key, ident, int(time.time()), body)
        try:
            async with asyncio.timeout(TIMEOUT_S):  # the whole request: a slow trickle is a failure
                reply = await http.post(url, content=body, headers=headers)
        except (httpx.HTTPError, TimeoutError) as e:
            failed.append(f"{url}: {type(e).__name__}: {e}")
            continue
        if 200 <= reply.status_code < 300:
            await client.hset(keys.webhook(ident), f"ok:{digest}", "1")
        else:
            failed.append(f"{url}: HTTP {reply.status_code}")
    if failed:
        log.warning("webhook %s not delivered: %s", ident, "; ".join(failed))
    await settle(client, keys, ident, failed)
    return "failed" if failed else "delivered"
