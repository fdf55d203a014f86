"""Request entries to and from Redis: msgpack (field ``m``) or plain string fields (redis-cli).

Nothing read from Redis is unpickled or evaluated: msgpack and JSON decode data, never code, and
sizes and nesting are bounded before anything walks the data.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgpack

from tokenfleet.errors import ProtocolError
from tokenfleet.protocol.constants import (
    BODY_FIELD,
    DEFAULT_REPLY_TTL_S,
    ERROR_REPLY_TTL_S,
    MAX_BODY_BYTES,
    MAX_ID_LEN,
    MAX_NESTING,
    ErrorCode,
)
from tokenfleet.protocol.request import Request
from tokenfleet.protocol.validation import (
    FLOAT_FIELDS,
    INT_FIELDS,
    LIST_FIELDS,
    MAP_FIELDS,
    request_id_of,
    validate_request,
)

Fields = dict[bytes, bytes]
"""A stream entry's fields as redis-py returns them."""

# plain-form numbers: ASCII digits only (int() takes "٣", "1_0" and " 5 ")
_PLAIN_INT_RE = re.compile(r"-?[0-9]{1,20}")
_PLAIN_FLOAT_RE = re.compile(r"-?(?:[0-9]{1,20}(?:\.[0-9]{0,20})?|\.[0-9]{1,20})(?:[eE][-+]?[0-9]{1,4})?")
_UNDECODABLE = (
    ValueError,
    TypeError,
    UnicodeDecodeError,
    msgpack.UnpackException,
    RecursionError,
    MemoryError,
)


def pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def as_text(value: Any) -> str:
    """A value redis-py returns (bytes, or anything else) as text: key names, stream ids, fields."""
    return value.decode() if isinstance(value, bytes) else str(value)


def unpack(data: bytes) -> Any:
    """Decode msgpack data from Redis: plain data only, bounded size and nesting, no extension
    types. Raises ``ValueError`` (or msgpack's own errors) on anything else."""
    if len(data) > MAX_BODY_BYTES:
        raise ValueError(f"body is larger than {MAX_BODY_BYTES} bytes")
    obj = msgpack.unpackb(data, raw=False, ext_hook=_reject_ext, strict_map_key=True, timestamp=0)
    check_nesting(obj)
    return obj


def check_nesting(obj: Any, limit: int = MAX_NESTING) -> None:
    """Raise ``ValueError`` if lists and maps nest deeper than ``limit``; iterative (a recursive
    walk is what a deep entry would break), and a flat list costs one pass in C."""
    if not isinstance(obj, (list, tuple, dict)):
        return
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        if not set(map(type, children)) & {list, tuple, dict}:
            continue
        if depth >= limit:
            raise ValueError(f"lists and maps nest deeper than {limit}")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (list, tuple, dict)))


def encode_request(request: Request) -> Fields:
    """Stream fields of a request in the msgpack form."""
    return {BODY_FIELD: pack(request.to_wire())}


def decode_request(fields: Fields) -> Request:
    """Decode and validate a request stream entry; raises :class:`ProtocolError`."""
    return validate_request(decode_request_body(fields))


def decode_request_body(fields: Fields) -> dict[str, Any]:
    """A request entry's fields as a plain map, not yet validated; raises :class:`ProtocolError`
    (``undecodable``, dead-lettered) when the body cannot be decoded."""
    try:
        if sum(len(k) + len(v) for k, v in fields.items()) > MAX_BODY_BYTES:
            raise ValueError(f"entry is larger than {MAX_BODY_BYTES} bytes")
        if BODY_FIELD in fields:
            body = unpack(fields[BODY_FIELD])
            if not isinstance(body, dict):
                raise ValueError(f"body is a msgpack {type(body).__name__}, not a map")
            return body
        plain = {k.decode("utf-8"): v.decode("utf-8") for k, v in fields.items()}
        return {k: _plain_value(k, v) for k, v in plain.items()}
    except _UNDECODABLE as e:  # RecursionError and MemoryError too: an entry costs only itself
        raise ProtocolError(
            ErrorCode.UNDECODABLE, f"cannot decode request body: {e}", dead_letter=True
        ) from e


def _plain_value(name: str, raw: str) -> Any:
    """One plain-string field by the schema's type: exactly the forms PROTOCOL.md gives (ASCII
    decimal numbers, JSON arrays); anything else stays a string, which validation refuses."""
    if name in INT_FIELDS:
        return int(raw) if _PLAIN_INT_RE.fullmatch(raw) else raw
    if name in FLOAT_FIELDS:
        return float(raw) if _PLAIN_FLOAT_RE.fullmatch(raw) else raw
    if name in LIST_FIELDS or name in MAP_FIELDS:
        if raw.count("[") + raw.count("{") > MAX_NESTING:
            _check_json_nesting(raw)  # only then can it be too deep: flat arrays skip the scan
        try:
            value = json.loads(raw)  # JSON arrays and objects: data only, never evaluated
        except ValueError:
            return raw
        check_nesting(value)
        return value
    if name == "ignore_eos":
        return {"true": True, "1": True, "false": False, "0": False}.get(raw.lower(), raw)
    return raw


def _check_json_nesting(raw: str) -> None:
    """Raise ``ValueError`` if a JSON text nests deeper than :data:`MAX_NESTING`, before the
    parser (which recurses) sees it."""
    depth, in_string, escaped = 0, False, False
    for ch in raw:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise ValueError(f"lists and maps nest deeper than {MAX_NESTING}")
        elif ch in "]}":
            depth -= 1


def salvage_reply(fields: Fields) -> tuple[str | None, int]:
    """Where an error reply to an entry that will not decode goes: its request id if one can be
    read (else None), and the reply TTL (its own ``reply_ttl_s`` where valid, else
    :data:`ERROR_REPLY_TTL_S`). Never raises, whatever the entry holds."""
    try:
        body: Any = decode_request_body(fields)
    except Exception:  # noqa: BLE001 (the salvage of a broken entry must not break in turn)
        body = None
    if body is not None:
        value = body.get("reply_ttl_s", DEFAULT_REPLY_TTL_S)
        lo, hi = INT_FIELDS["reply_ttl_s"]
        valid = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
        return request_id_of(body), value if valid else ERROR_REPLY_TTL_S
    return _salvage_id(fields), ERROR_REPLY_TTL_S


def _salvage_id(fields: Fields) -> str | None:
    """The id of an undecodable entry: a msgpack body whose other strings are not UTF-8 still
    names it, and so does a plain form's ``id`` field."""
    try:
        data = fields[BODY_FIELD]
        if len(data) <= MAX_BODY_BYTES:
            lenient = msgpack.unpackb(data, raw=False, unicode_errors="surrogateescape", ext_hook=_reject_ext)
            check_nesting(lenient)
            rid = request_id_of(lenient) if isinstance(lenient, dict) else None
            if rid is not None:
                return rid
    except Exception:  # noqa: BLE001 (the salvage of a broken entry must not break in turn)
        pass
    raw = fields.get(b"id") if isinstance(fields, dict) else None
    if isinstance(raw, bytes) and len(raw) <= MAX_ID_LEN:
        try:
            return request_id_of({"id": raw.decode("utf-8")})
        except UnicodeDecodeError:
            return None
    return None
