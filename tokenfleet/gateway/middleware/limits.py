"""Bounds checked before work: a request body larger than the gateway takes is answered 413, in
OpenAI's error shape, before it is read (by its ``Content-Length``) or as soon as it passes the
limit (a chunked body), so one caller's 50 MB prompt costs the gateway nothing that other callers
would feel. Batch API uploads (``/v1/files``) have their own, larger limit."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.gateway.errors import APIError, answer_for

UPLOAD_PATHS = ("/v1/files",)
MULTIPART_SLACK = 64 << 10  # a form's boundaries and fields around the file itself


class BodyLimit:
    """413 for a body over ``limit`` bytes (``upload_limit`` on the upload routes)."""

    def __init__(self, app: ASGIApp, limit: int, upload_limit: int):
        self.app, self.limit, self.upload_limit = app, limit, upload_limit + MULTIPART_SLACK

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_limit if scope["path"] in UPLOAD_PATHS else self.limit
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit():  # announced: refused unread, or passed on as it comes
            if int(length) > limit:
                await answer_for(scope["path"], too_large(limit))(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # chunked: read up to the limit here, then hand the app what came (it buffers it anyway)
        chunks: list[Message] = []
        received = 0
        while True:
            message = await receive()
            chunks.append(message)
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > limit:
                await answer_for(scope["path"], too_large(limit))(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this gateway takes ({limit} bytes; --max-request-bytes)",
        code="request_too_large",
    )
