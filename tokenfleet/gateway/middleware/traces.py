"""Each API request's span, and the trace context its queued requests carry.

The caller's W3C ``traceparent`` header (if valid) is the parent; without one a trace starts
here. Routes read ``request.state.traceparent`` (this gateway's span, or without a tracer the
caller's header as it came) and put it on the requests they queue, so workers record their spans
under it. Plain ASGI: a stream's span ends when its last byte has gone."""

from __future__ import annotations

import time

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.protocol import valid_traceparent
from tokenfleet.tracing import Tracer

TRACED = "/v1/"


class TraceContext:
    def __init__(self, app: ASGIApp, tracer: Tracer | None):
        self.app, self.tracer = app, tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(TRACED):
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("traceparent")
        parent = given if valid_traceparent(given) else None
        state = scope.setdefault("state", {})
        if self.tracer is None:
            state["traceparent"] = parent
            await self.app(scope, receive, send)
            return
        name = f"{scope['method']} {scope['path']}"
        span = self.tracer.start(
            name, parent, time.time(), {"http.method": scope["method"], "url.path": scope["path"]}
        )
        state["traceparent"] = self.tracer.traceparent(span)

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.status_code", message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            span.end()
