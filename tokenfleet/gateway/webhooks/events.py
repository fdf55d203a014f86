"""Webhook events in OpenAI's shape and their Standard Webhooks signature. No I/O.

An event's id is a function of what it announces (the type and the object's id), so two
replicas that both see a response end raise one event, and a receiver deduplicates retries by
``webhook-id``."""

from __future__ import annotations

import base64
import hashlib
import hmac

import orjson

RESPONSE_ENDINGS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.cancelled",
}
BATCH_ENDINGS = {
    "completed": "batch.completed",
    "failed": "batch.failed",
    "cancelled": "batch.cancelled",
    "expired": "batch.expired",
}


def event_id(kind: str, object_id: str) -> str:
    return "evt_" + hashlib.sha256(f"{kind}/{object_id}".encode()).hexdigest()[:32]


def event_body(kind: str, object_id: str, created_at: int) -> bytes:
    """``{"id", "object": "event", "created_at", "type", "data": {"id"}}``, as OpenAI sends."""
    event = {
        "id": event_id(kind, object_id),
        "object": "event",
        "created_at": created_at,
        "type": kind,
        "data": {"id": object_id},
    }
    return orjson.dumps(event)


def signed_headers(key: bytes, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """Standard Webhooks' headers: ``v1,`` and the base64 HMAC-SHA256 of ``id.timestamp.body``."""
    mac = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": "v1," + base64.b64encode(mac.digest()).decode(),
        "content-type": "application/json",
    }
