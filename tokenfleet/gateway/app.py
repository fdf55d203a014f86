"""The gateway's FastAPI app: routes, API keys, Prometheus metrics, health, and the Batch API's
job runner thread."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import redis
from fastapi import FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.config import GatewayConfig
from tokenfleet.config.webhooks import secret_key
from tokenfleet.gateway import batches, completions, dashboard, embeddings, errors, files, models
from tokenfleet.gateway.errors import APIError, answer_for
from tokenfleet.gateway.messages import routes as messages
from tokenfleet.gateway.middleware.limits import BodyLimit
from tokenfleet.gateway.middleware.traces import TraceContext
from tokenfleet.gateway.responses import routes as responses
from tokenfleet.gateway.service import Service
from tokenfleet.gateway.webhooks.delivery import deliver_forever
from tokenfleet.gateway.webhooks.watch import watch_forever
from tokenfleet.protocol import valid_tenant
from tokenfleet.ratelog import RateLimitedLog
from tokenfleet.tracing import Tracer
from tokenfleet.transport.server.connection import connect_server
from tokenfleet.transport.server.memory import RECHECK_S, read_memory_policy
from tokenfleet.transport.status import lane_queues

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/metrics", "/fleet/queues")  # probes, scrapers and autoscalers need no key
DASHBOARD = "/dashboard"  # asks its own keys: viewers' and admins' (gateway/dashboard/access.py)


def create_app(config: GatewayConfig) -> FastAPI:
    bad = [tenant for tenant in config.tenants.values() if not valid_tenant(tenant)]
    if bad:
        raise ValueError(f"tenant {bad[0]!r}: 1-64 characters of [A-Za-z0-9._:-], a letter or digit first")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.service = Service.start(config)
        if config.dashboard:
            app.state.console = dashboard.open_console(config.redis.url, _fleets(config), _access(config))
        stop = threading.Event()
        runner = _start_batch_jobs(config, stop) if config.batch_jobs else None
        hooks = _start_webhooks(app.state.service, metrics) if config.webhook_urls else []
        try:
            yield
        finally:
            for task in hooks:
                task.cancel()
            stop.set()
            if runner is not None:
                runner.join(timeout=10)
            await app.state.service.close()
            if tracer is not None:
                tracer.shutdown()
            if config.dashboard:
                await dashboard.close_console(app.state.console)

    tracer = Tracer.exporting("tokenfleet-gateway", config.otlp_traces_endpoint)
    app = FastAPI(
        title="tokenfleet", summary="OpenAI-compatible API over a tokenfleet fleet", lifespan=lifespan
    )
    errors.install(app)
    metrics = _Metrics()
    # plain ASGI, not @app.middleware: that wrapper hides a client's disconnect from the routes
    app.add_middleware(BodyLimit, limit=config.max_request_bytes, upload_limit=config.max_file_bytes)
    app.add_middleware(TraceContext, tracer=tracer)
    app.add_middleware(_Guard, keys=config.keys, tenants=config.tenants, metrics=metrics)  # keys first

    @app.get("/health")
    async def health(request: Request) -> Response:
        try:
            await request.app.state.service.client.redis.ping()
        except Exception as e:  # Redis down: this replica cannot serve
            return APIError(503, f"redis unavailable: {e}", "api_error").response()
        return Response('{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if time.monotonic() - metrics.memory_checked > RECHECK_S:
            metrics.memory_checked = time.monotonic()
            service = request.app.state.service
            with contextlib.suppress(redis.RedisError):
                policy = await asyncio.to_thread(read_memory_policy, service.sync_redis())
                metrics.redis_evicting.set(-1 if policy.policy is None else int(policy.evicting))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/fleet/queues")
    async def fleet_queues(request: Request) -> dict[str, Any]:
        """Per lane, requests waiting and in flight over every stream: KEDA's metrics-api
        trigger scales the workers on it (deploy/k8s/base/keda.yaml)."""
        service = request.app.state.service
        return await asyncio.to_thread(lane_queues, service.sync_redis(), service.client.keys)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        """Served models, then the adapters of served models (``parent``: their base), as vLLM."""
        service = request.app.state.service
        served = await service.fleet.models()
        everything = {*served, *await service.embed_fleet.models()}  # the embedding fleet's too
        model = {"object": "model", "created": 0, "owned_by": "tokenfleet"}
        data = [{"id": name, **model, "root": name, "parent": None} for name in sorted(everything)]
        for name, record in sorted((await service.adapters.records()).items()):
            parent = record.base or (next(iter(served)) if len(served) == 1 else None)
            if parent in served:
                data.append({"id": name, **model, "root": record.path, "parent": parent})
        return {"object": "list", "data": data}

    routers = (completions, responses, messages, embeddings, files, batches, models)
    for router in (module.router for module in routers):
        app.include_router(router)
    if config.dashboard:
        app.include_router(dashboard.router)
    return app


def _fleets(config: GatewayConfig) -> list[str]:
    """The dashboard's fleets: this gateway's, and the embedding fleet where it is another."""
    return [config.redis.prefix, *([config.embed_prefix] if config.embed_prefix else [])]


def _access(config: GatewayConfig) -> dashboard.Access:
    """Admins act, viewers look; where the gateway asks no key at all, anyone may look."""
    open_view = not config.keys and not config.viewers
    return dashboard.Access(config.admins, config.viewers, open_view)


class _Guard:
    """API keys (``Authorization: Bearer``) on every route but the probes', and each request's
    route, status and time to its response's start counted."""

    def __init__(self, app: ASGIApp, keys: frozenset[str], tenants: dict[str, str], metrics: _Metrics):
        self.app, self.keys, self.tenants, self.metrics = app, keys, tenants, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = getattr(scope.get("route"), "path", "unmatched")
                self.metrics.observe(route, message["status"], time.perf_counter() - started)
            await send(message)

        path = scope["path"]
        checked = path not in OPEN_PATHS and path != DASHBOARD and not path.startswith(DASHBOARD + "/")
        key = self._key(Headers(scope=scope)) if self.keys and checked else None
        if self.keys and checked and key is None:
            message = "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)"
            refused = APIError(401, message, "authentication_error", "invalid_api_key")
            await answer_for(path, refused)(scope, receive, counted)
            return
        scope.setdefault("state", {})["tenant"] = self.tenants.get(key) if key else None
        await self.app(scope, receive, counted)

    def _key(self, headers: Headers) -> str | None:
        """The accepted key sent as ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (the
        Anthropic SDK's header); None where none is."""
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = headers.get("x-api-key", "")
        given_bytes = given.strip().encode()  # compare_digest refuses str beyond ASCII
        matched = [key for key in self.keys if hmac.compare_digest(given_bytes, key.encode())]
        return matched[0] if given_bytes and matched else None


class _Metrics:
    """The gateway's own series (each worker exports its own on --metrics-port)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokenfleet_gateway_requests",
            "HTTP requests by route and status.",
            ("route", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "tokenfleet_gateway_request_seconds",
            "Time to the response's headers (streams: to their first event).",
            ("route",),
            registry=self.registry,
        )

        self.redis_evicting = Gauge(
            "tokenfleet_redis_evicting",
            "1: Redis's maxmemory-policy may delete our keys (not noeviction); 0: safe; -1: unknown.",
            registry=self.registry,
        )
        self.redis_evicting.set(-1)
        self.memory_checked = float("-inf")

        self.webhooks = Counter(
            "tokenfleet_gateway_webhook_attempts",
            "Webhook delivery attempts by outcome (delivered, failed: retried later, expired).",
            ("outcome",),
            registry=self.registry,
        )

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)


def _start_webhooks(service: Service, metrics: _Metrics) -> list[asyncio.Task[None]]:
    """Deliver due webhook events and follow background responses to their end (each replica)."""
    config, client = service.config, service.client
    key = secret_key(config.webhook_secret or "")
    count = partial(_count, metrics.webhooks)
    delivering = deliver_forever(client.redis, client.keys, config.webhook_endpoints, key, count)
    return [asyncio.create_task(delivering), asyncio.create_task(watch_forever(service))]


def _count(counter: Counter, outcome: str) -> None:
    counter.labels(outcome=outcome).inc()


def _start_batch_jobs(config: GatewayConfig, stop: threading.Event) -> threading.Thread:
    """An RQ worker thread for Batch API jobs (no fork: a SimpleWorker); every replica may run one,
    and each job runs once."""
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer
    from rq.timeouts import TimerDeathPenalty

    from tokenfleet.producer.rq_jobs import rq_queue

    class ThreadWorker(SimpleWorker):
        """RQ's in-process worker, off the main thread: a timer, not SIGALRM, bounds a job, and
        the process's signals stay uvicorn's."""

        death_penalty_class = TimerDeathPenalty

        def _install_signal_handlers(self) -> None:
            pass

        # RQ's command channel (stop or kill a job) is not used here: a batch is cancelled through
        # its own record. Its pub/sub thread, made and stopped on every one-second pass, could hold a
        # pass (and the gateway's shutdown) for up to a minute in redis-py's stop()
        def subscribe(self) -> None:
            pass

        def unsubscribe(self) -> None:
            pass

    def work() -> None:
        connection = connect_server(config.redis.url)
        queue = Queue(rq_queue(config.redis.prefix), connection=connection, serializer=JSONSerializer)
        worker = ThreadWorker([queue], connection=connection, serializer=JSONSerializer)
        warn = RateLimitedLog(log)  # a full Redis fails every pass: one line per 10 s
        while not stop.is_set():
            try:  # one pass over what is queued, then a short wait: a stop is noticed within a second
                worker.work(burst=True, with_scheduler=False, logging_level="WARNING")
            except redis.RedisError as e:  # Redis away or full: one line, the loop retries
                warn.log(logging.WARNING, "redis", "batch job runner: %s; retrying", e)
            except Exception:  # a bug: the loop retries; jobs resume by their request ids
                log.warning("batch job runner failed; retrying", exc_info=True)
            stop.wait(1.0)

    thread = threading.Thread(target=work, name="tokenfleet-batch-jobs", daemon=True)
    thread.start()
    return thread
