"""The dead-letter stream as an operator handles it: list, inspect, requeue, delete.

A dead letter keeps the entry's fields (up to ``DEAD_LETTER_BODY_BYTES``), the stream it came from
and why it failed. Requeueing puts those fields back on that stream as a new entry, under the same
request id: the id's old answer (its ``error`` reply, its owner record, a cancel flag) is cleared
first, so the request runs again and its reply stream holds the new answer.
"""

from __future__ import annotations

import base64
import contextlib
import re
from typing import Any

import redis

from tokenfleet import protocol
from tokenfleet.gateway.dashboard.access import Refused
from tokenfleet.protocol import ErrorCode, Keys, as_text

LIST_LIMIT = 200  # dead letters listed at once, newest first
REQUEUE_ALL_LIMIT = 500  # dead letters one "requeue all" puts back (the oldest first); again for more
ENTRY_ID = re.compile(r"\d{1,20}-\d{1,20}")


def listing(client: redis.Redis, keys: Keys, count: int = LIST_LIMIT) -> dict[str, Any]:
    """The newest ``count`` dead letters (without their bodies) and how many there are."""
    raw: Any = client.xrevrange(keys.dead_letter, count=max(1, min(count, LIST_LIMIT)))
    return {"total": client.xlen(keys.dead_letter), "data": [_summary(i, f) for i, f in raw]}


def inspect(client: redis.Redis, keys: Keys, letter_id: str) -> dict[str, Any]:
    """One dead letter with its entry's fields decoded for reading (bytes that are not UTF-8 as
    base64); :class:`Refused` (404) where it is gone."""
    fields = _read(client, keys, letter_id)
    entry = _entry_fields(fields)
    view = {as_text(k): _readable(v) for k, v in entry.items()} if entry is not None else None
    body = entry.get(protocol.BODY_FIELD) if entry else None
    if body is not None:
        with contextlib.suppress(ValueError):  # not msgpack: shown as it is
            view = {**(view or {}), as_text(protocol.BODY_FIELD): _readable(protocol.unpack(body))}
    return {**_summary(letter_id, fields), "entry_fields": view}


def requeue(client: redis.Redis, keys: Keys, letter_id: str) -> dict[str, Any]:
    """Put dead letter ``letter_id`` back on its stream (see the module's note) and remove it from
    the dead letters, in one transaction; the new entry's id and the request id."""
    fields = _read(client, keys, letter_id)
    summary = _summary(letter_id, fields)
    entry = _entry_fields(fields)
    if entry is None or not summary["requeueable"]:
        raise Refused(409, f"dead letter {letter_id}: {summary['why_not_requeueable']}")
    stream, request_id = summary["stream"], summary["request_id"]
    if not stream.startswith(keys.request_stream("")):
        raise Refused(409, f"dead letter {letter_id} came from {stream!r}, not a request stream")
    if request_id is not None:
        owner = client.get(keys.owner(request_id))
        if owner is not None and as_text(owner) != f"{stream} {summary['entry']}":
            raise Refused(409, f"request id {request_id!r} now belongs to another entry ({as_text(owner)})")
    if not client.xdel(keys.dead_letter, letter_id):  # the claim: two requeues of one letter, one wins
        raise Refused(409, f"dead letter {letter_id} was just requeued or deleted")
    try:
        pipe = client.pipeline(transaction=False)
        if request_id is not None:  # one key per DEL: on a cluster they live in different slots
            for key in (keys.reply_stream(request_id), keys.owner(request_id), keys.cancel(request_id)):
                pipe.delete(key)
        pipe.xadd(stream, dict[Any, Any](entry))
        new_entry = pipe.execute()[-1]
    except redis.RedisError:  # not requeued: the letter goes back (under a new id) for another try
        client.xadd(
            keys.dead_letter, dict[Any, Any](fields), maxlen=protocol.DEAD_LETTER_MAXLEN, approximate=True
        )
        raise
    return {"requeued": letter_id, "stream": stream, "entry": as_text(new_entry), "request_id": request_id}


def delete(client: redis.Redis, keys: Keys, letter_id: str) -> dict[str, Any]:
    """Remove one dead letter; :class:`Refused` (404) where it is gone."""
    _read(client, keys, letter_id)  # a whole id, and there
    if not client.xdel(keys.dead_letter, letter_id):
        raise Refused(404, f"no dead letter {letter_id}")
    return {"deleted": letter_id}


def requeue_all(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Requeue the oldest :data:`REQUEUE_ALL_LIMIT` dead letters that can be; those that cannot
    stay, with the reason; ``remaining``: how many are left in all."""
    raw: Any = client.xrange(keys.dead_letter, count=REQUEUE_ALL_LIMIT)
    done, left = [], []
    for letter_id, _ in raw:
        try:
            done.append(requeue(client, keys, as_text(letter_id))["requeued"])
        except Refused as e:
            left.append({"id": as_text(letter_id), "reason": e.message})
    return {"requeued": len(done), "left": left[:20], "remaining": client.xlen(keys.dead_letter)}


def delete_all(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Remove every dead letter (UNLINK: Redis frees a long stream off its main thread)."""
    pipe = client.pipeline(transaction=True)
    pipe.xlen(keys.dead_letter)
    pipe.unlink(keys.dead_letter)
    count, _ = pipe.execute()
    return {"deleted": count}


def _read(client: redis.Redis, keys: Keys, letter_id: str) -> dict[bytes, bytes]:
    if not ENTRY_ID.fullmatch(letter_id):  # whole ids only: "-", "+" or "1700000000000" name ranges
        raise Refused(400, f"{letter_id!r} is not a dead letter's id (<ms>-<n>)")
    raw: Any = client.xrange(keys.dead_letter, min=letter_id, max=letter_id)
    if not raw:
        raise Refused(404, f"no dead letter {letter_id!r}")
    fields: dict[bytes, bytes] = raw[0][1]
    return fields


def _summary(letter_id: Any, fields: dict[bytes, bytes]) -> dict[str, Any]:
    body = fields.get(b"body", b"")
    size = int(fields.get(b"body_bytes", len(body)))
    entry = _entry_fields(fields)
    request_id = protocol.salvage_reply(entry)[0] if entry is not None else None
    code = as_text(fields.get(b"code", b""))
    why_not = None
    if entry is None:
        why_not = "only part of the entry was kept (a large one): resubmit it instead"
    elif code == ErrorCode.UNDECODABLE:
        why_not = "the entry cannot be decoded: requeued, it would fail again"
    return {
        "id": as_text(letter_id),
        "stream": as_text(fields.get(b"stream", b"")),
        "entry": as_text(fields.get(b"entry", b"")),
        "code": code,
        "reason": as_text(fields.get(b"reason", b"")),
        "worker": as_text(fields.get(b"worker", b"")),
        "at": float(fields.get(b"at", 0) or 0),
        "body_bytes": size,
        "truncated": size > len(body),
        "request_id": request_id,
        "requeueable": why_not is None,
        "why_not_requeueable": why_not,
    }


def _entry_fields(fields: dict[bytes, bytes]) -> dict[bytes, bytes] | None:
    """The failed entry's own fields, where the dead letter kept all of them."""
    body = fields.get(b"body", b"")
    if int(fields.get(b"body_bytes", len(body))) > len(body):
        return None
    try:
        entry = protocol.unpack(body)
    except ValueError:
        return None
    if not isinstance(entry, dict) or not all(isinstance(k, bytes | str) for k in entry):
        return None
    return {_bytes(k): _bytes(v) for k, v in entry.items()}


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _readable(value: Any) -> Any:
    """``value`` with bytes turned to text (UTF-8, else base64), for JSON."""
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {str(_readable(k)): _readable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_readable(v) for v in value]
    return value
