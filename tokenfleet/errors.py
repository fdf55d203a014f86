"""The exceptions tokenfleet raises, in one place."""

from __future__ import annotations


class TokenfleetError(Exception):
    """Base class of every tokenfleet exception."""


class ProtocolError(TokenfleetError):
    """Data read from Redis that breaks the wire contract: a request that does not decode or
    validate, or a reply event that is not one.

    ``code`` is a stable :class:`~tokenfleet.protocol.ErrorCode`; ``request_id`` the id to answer
    when one could be read; ``dead_letter`` when the entry cannot be answered at all (no usable
    id, an unknown protocol version) and belongs on the dead-letter stream.
    """

    def __init__(self, code: str, message: str, *, request_id: str | None = None, dead_letter: bool = False):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.dead_letter = dead_letter


class RequestFailed(TokenfleetError):
    """The worker answered a request with an ``error`` event."""

    def __init__(self, request_id: str, code: str, message: str):
        super().__init__(f"request {request_id} failed: {code}: {message}")
        self.request_id = request_id
        self.code = code
        self.message = message


class RedisFull(TokenfleetError):
    """Redis refused the enqueue: it reached ``maxmemory`` under ``noeviction`` (nothing queued)."""


class QueueFull(TokenfleetError):
    """A bucket's request stream holds more waiting entries than its ``max_queue``."""


class ResultTimeout(TokenfleetError):
    """No terminal event arrived on a reply stream within the caller's timeout."""
