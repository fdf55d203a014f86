"""The dashboard's HTTP side: the page (static files shipped in the package: no CDN), and the JSON
it polls, under ``/dashboard/api``. Reads need a viewer's key (or none, where the console is open);
actions an admin's, and each is recorded (:mod:`tokenfleet.gateway.dashboard.access`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Annotated, Any

import redis
import redis.asyncio
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

# each module by its full name: `from <package> import` would make the package import itself
import tokenfleet.gateway.dashboard.access as access
import tokenfleet.gateway.dashboard.dead_letters as dead_letters
import tokenfleet.gateway.dashboard.fleet as fleet
import tokenfleet.gateway.dashboard.jobs as jobs
import tokenfleet.gateway.dashboard.lookup as lookup
from tokenfleet.gateway.dashboard.access import Access, Refused
from tokenfleet.protocol import Keys, valid_request_id

router = APIRouter(prefix="/dashboard", include_in_schema=False)
SCRIPTS = ("app.js", "charts.js", "requests.js")
STATIC = {name: "text/javascript" for name in SCRIPTS} | {"style.css": "text/css"}
FOLLOW_LIMIT_S = 900.0  # longest a page follows one request's reply
FOLLOW_BLOCK_MS = 2000  # one blocking read; between reads a closed page is noticed
MAX_FOLLOWS = 32  # replies followed at once by one dashboard process (each holds a connection)
STREAM_ID = re.compile(r"\d{1,20}(-\d{1,20})?")
log = logging.getLogger("tokenfleet.dashboard")
Fleet = Annotated[str | None, Query(alias="fleet")]  # which fleet (prefix); default: the first


@dataclass
class Console:
    """What the dashboard reads and acts on: the fleets (one per prefix) on one Redis."""

    sync: redis.Redis
    aio: redis.asyncio.Redis
    fleets: dict[str, Keys]
    access: Access
    follows: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(MAX_FOLLOWS))

    def keys(self, prefix: str | None) -> Keys:
        if prefix is None:
            return next(iter(self.fleets.values()))
        if prefix not in self.fleets:
            raise Refused(404, f"no fleet {prefix!r} here (these: {', '.join(self.fleets)})")
        return self.fleets[prefix]


def _console(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def _redis_refused(e: redis.RedisError) -> Refused:
    if isinstance(e, redis.exceptions.NoPermissionError):
        return Refused(403, f"Redis refused (the dashboard's Redis user may not do this): {e}")
    return Refused(503, f"redis: {e}")


def _fail(e: Refused) -> Response:
    return JSONResponse({"error": {"message": e.message, "code": e.status}}, status_code=e.status)


Read = Callable[[redis.Redis, Keys], Any]  # what a route does with the fleet's Redis and keys


async def _view(request: Request, fleet_name: str | None, read: Read) -> Response:
    """Answer a read: the caller may view, and ``read`` runs on a thread (it blocks on Redis)."""
    console = _console(request)
    try:
        console.access.viewer(request.headers.get("authorization"))
        keys = console.keys(fleet_name)
        return JSONResponse(await asyncio.to_thread(read, console.sync, keys))
    except Refused as e:
        return _fail(e)
    except redis.RedisError as e:  # Redis away, or this user may not read that
        return _fail(_redis_refused(e))
    except Exception as e:  # a bug, or a record we cannot read: one clear answer, the trace in the log
        log.exception("dashboard read failed")
        return _fail(Refused(500, f"{type(e).__name__}: {e}"))


async def _act(request: Request, fleet_name: str | None, action: str, target: str, act: Read) -> Response:
    """Answer an action: an admin's only, recorded whatever its outcome."""
    console = _console(request)
    try:
        who = console.access.admin(request.headers.get("authorization"))
        keys = console.keys(fleet_name)
    except Refused as e:  # not an action taken: logged, not recorded on the fleet's audit stream
        client = request.client.host if request.client else "?"
        log.warning("dashboard action %s %s refused (from %s): %s", action, target, client, e.message)
        return _fail(e)
    refused: Refused | None = None
    try:
        outcome = await asyncio.to_thread(act, console.sync, keys)
    except Refused as e:
        outcome, refused = {"refused": e.message}, e
    except redis.RedisError as e:  # part of it may have been done: say what Redis said
        refused = _redis_refused(e)
        outcome = {"refused": refused.message}
    except Exception as e:  # a bug: answered and recorded like any outcome, the trace in the log
        log.exception("dashboard action %s %s failed", action, target)
        refused = Refused(500, f"{type(e).__name__}: {e}")
        outcome = {"refused": refused.message}
    with contextlib.suppress(redis.RedisError):  # logged first: the log line stands whatever Redis says
        await asyncio.to_thread(access.record, console.sync, keys, who, action, target, outcome)
    return _fail(refused) if refused is not None else JSONResponse(outcome)


@router.get("")
async def page() -> Response:
    """The page itself holds no data: it asks for a key, then polls the API below."""
    return Response(_asset("index.html"), media_type="text/html; charset=utf-8")


@router.get("/static/{name}")
async def static(name: str, request: Request) -> Response:
    if name not in STATIC:
        return _fail(Refused(404, f"no file {name!r}"))
    tag = f'"{assets_digest()}"'  # the browser asks again each time, and gets 304 while unchanged
    if request.headers.get("if-none-match") == tag:
        return Response(status_code=304, headers={"ETag": tag})
    return Response(_asset(name), media_type=STATIC[name], headers={"Cache-Control": "no-cache", "ETag": tag})


def _asset(name: str) -> bytes:
    return resources.files("tokenfleet.gateway.dashboard").joinpath("static", name).read_bytes()


@functools.cache
def assets_digest() -> str:
    """A digest of the page's files (its version: the docs' screenshots name the one they show)."""
    digest = hashlib.sha256()
    for name in ("index.html", *sorted(STATIC)):
        digest.update(name.encode() + b"\0" + _asset(name))
    return digest.hexdigest()[:16]


@router.get("/api/whoami")
async def whoami(request: Request) -> Response:
    console = _console(request)
    authorization = request.headers.get("authorization")
    try:
        who = console.access.viewer(authorization)
    except Refused as e:
        return _fail(e)
    try:
        console.access.admin(authorization)
        can_act = True
    except Refused:
        can_act = False
    return JSONResponse({"who": who, "can_act": can_act, "fleets": list(console.fleets)})


@router.get("/api/overview")
async def overview(request: Request, fleet_name: Fleet = None) -> Response:
    return await _view(request, fleet_name, lambda client, keys: fleet.overview(client, keys))


@router.get("/api/requests/{request_id}")
async def request_state(request: Request, request_id: str, fleet_name: Fleet = None) -> Response:
    if not valid_request_id(request_id):
        return _fail(Refused(400, f"{request_id!r} is not a request id"))
    return await _view(request, fleet_name, lambda client, keys: lookup.lookup(client, keys, request_id))


@router.get("/api/requests/{request_id}/follow")
async def follow(request: Request, request_id: str, after: str = "0", fleet_name: Fleet = None) -> Response:
    """The reply's events after ``after`` as they are written, one JSON object per line, until the
    terminal event (or :data:`FOLLOW_LIMIT_S`, or the page goes away)."""
    console = _console(request)
    try:
        console.access.viewer(request.headers.get("authorization"))
        keys = console.keys(fleet_name)
        if not valid_request_id(request_id):
            raise Refused(400, f"{request_id!r} is not a request id")
        if not STREAM_ID.fullmatch(after):
            raise Refused(400, f"after must be a reply event's id, got {after!r}")
        if console.follows.locked():
            raise Refused(429, f"{MAX_FOLLOWS} replies are followed already: close a page and retry")
    except Refused as e:
        return _fail(e)
    stream = keys.reply_stream(request_id)

    async def lines() -> AsyncIterator[bytes]:
        async with console.follows:
            cursor, ends = after, time.monotonic() + FOLLOW_LIMIT_S
            yield b'{"type":"following"}\n'  # the headers go out now
            try:
                while time.monotonic() < ends and not await request.is_disconnected():
                    reply: Any = await console.aio.xread({stream: cursor}, count=100, block=FOLLOW_BLOCK_MS)
                    for _, entries in reply or []:
                        for entry_id, fields in entries:
                            cursor = entry_id
                            event = lookup.event_view(entry_id, fields)
                            if event is None:
                                continue
                            yield (json.dumps(event) + "\n").encode()
                            if event["type"] in ("done", "error"):
                                return
            except redis.RedisError as e:  # the page says so and may look the request up again
                yield (json.dumps({"type": "interrupted", "message": f"redis: {e}"}) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.get("/api/dead")
async def dead(request: Request, fleet_name: Fleet = None, count: int = dead_letters.LIST_LIMIT) -> Response:
    return await _view(request, fleet_name, lambda client, keys: dead_letters.listing(client, keys, count))


@router.get("/api/dead/{letter_id}")
async def dead_letter(request: Request, letter_id: str, fleet_name: Fleet = None) -> Response:
    def read(client: redis.Redis, keys: Keys) -> Any:
        return dead_letters.inspect(client, keys, letter_id)

    return await _view(request, fleet_name, read)


@router.post("/api/dead/{letter_id}/requeue")
async def requeue(request: Request, letter_id: str, fleet_name: Fleet = None) -> Response:
    def act(client: redis.Redis, keys: Keys) -> Any:
        return dead_letters.requeue(client, keys, letter_id)

    return await _act(request, fleet_name, "requeue", letter_id, act)


@router.delete("/api/dead/{letter_id}")
async def delete_letter(request: Request, letter_id: str, fleet_name: Fleet = None) -> Response:
    def act(client: redis.Redis, keys: Keys) -> Any:
        return dead_letters.delete(client, keys, letter_id)

    return await _act(request, fleet_name, "delete", letter_id, act)


@router.post("/api/dead-all/requeue")
async def requeue_all(request: Request, fleet_name: Fleet = None) -> Response:
    return await _act(request, fleet_name, "requeue-all", "dead letters", dead_letters.requeue_all)


@router.post("/api/dead-all/delete")
async def delete_all(request: Request, fleet_name: Fleet = None) -> Response:
    return await _act(request, fleet_name, "delete-all", "dead letters", dead_letters.delete_all)


@router.get("/api/jobs")
async def job_list(request: Request, fleet_name: Fleet = None) -> Response:
    return await _view(request, fleet_name, lambda client, keys: {"data": jobs.listing(client, keys)})


@router.post("/api/jobs/{job_id}/cancel")
async def cancel_job(request: Request, job_id: str, fleet_name: Fleet = None) -> Response:
    def act(client: redis.Redis, keys: Keys) -> Any:
        return jobs.cancel(client, keys, job_id)

    return await _act(request, fleet_name, "cancel", job_id, act)


@router.get("/api/audit")
async def audit(request: Request, fleet_name: Fleet = None) -> Response:
    return await _view(request, fleet_name, lambda client, keys: {"data": access.recent(client, keys)})
