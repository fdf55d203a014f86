"""Errors in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) with the status
its clients act on: 400 invalid, 401 no key, 404 unknown, 429 queue full (retried after
``Retry-After``), 503 no worker, 504 past the deadline (not to be retried)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import OutOfMemoryError

from tokenfleet.errors import ProtocolError, QueueFull, RedisFull, RequestFailed, ResultTimeout
from tokenfleet.producer.openai.format import CLIENT_ERROR_CODES
from tokenfleet.producer.routing import queue_full_error
from tokenfleet.protocol import ErrorCode

QUEUE_FULL_RETRY_AFTER_S = 1


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(error: Exception) -> APIError:
    """What an exception from the client side of tokenfleet means to an HTTP caller."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, QueueFull):
        retry = {"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}
        return APIError(429, str(error), "rate_limit_error", "queue_full", headers=retry)
    if isinstance(error, RedisFull):  # retryable once Redis has room: 503, as OpenAI's overload
        return APIError(503, str(error), "api_error", "redis_full")
    if isinstance(error, OutOfMemoryError):  # the gateway's own write (a record, a file) refused
        return api_error(queue_full_error(error) or RedisFull(str(error)))
    if isinstance(error, RequestFailed):
        return reply_error(error.code, error.message)
    if isinstance(error, ResultTimeout):
        return deadline_error(str(error))
    if isinstance(error, ProtocolError):
        return APIError(400, error.message, code=error.code)
    if isinstance(error, ValueError):
        return APIError(400, str(error), code=ErrorCode.INVALID_REQUEST)
    return APIError(500, f"{type(error).__name__}: {error}", "api_error", ErrorCode.INTERNAL)


def reply_error(code: str, message: str) -> APIError:
    """An ``error`` reply event as an HTTP error."""
    if code == ErrorCode.DEADLINE_EXCEEDED:
        return deadline_error(message)
    if code in CLIENT_ERROR_CODES:
        return APIError(400, message, code=code)
    if code == ErrorCode.LOST:  # Redis lost the reply: worth one more try, as OpenAI's 503s are
        return APIError(503, message, "api_error", code)
    return APIError(500, message, "api_error", code)


def deadline_error(message: str) -> APIError:
    return APIError(504, message, "timeout", ErrorCode.DEADLINE_EXCEEDED, headers={"x-should-retry": "false"})


ANTHROPIC_PATHS = "/v1/messages"  # its clients read Anthropic's error shape
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(error: APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``, Anthropic's shape of ``error``."""
    kind = ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def answer_for(path: str, error: APIError) -> JSONResponse:
    """``error`` in the shape the clients of ``path`` read."""
    if path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_error(error), status_code=error.status, headers=error.headers)
    return error.response()


def _answer(request: Request, error: APIError) -> JSONResponse:
    return answer_for(request.url.path, error)


def install(app: FastAPI) -> None:
    """Every error the app raises, answered in OpenAI's shape (Anthropic's under /v1/messages)."""

    @app.exception_handler(APIError)
    async def _api(request: Request, error: APIError) -> JSONResponse:
        return _answer(request, error)

    @app.exception_handler(OutOfMemoryError)
    async def _redis_full(request: Request, error: OutOfMemoryError) -> JSONResponse:
        return _answer(request, api_error(error))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg"))
        if first.get("type") == "extra_forbidden":  # a field we would otherwise ignore
            message = f"{where} is not supported by this gateway (docs/operations/gateway.md lists what is)"
        return _answer(request, APIError(400, message, param=where or None, code=ErrorCode.INVALID_REQUEST))
