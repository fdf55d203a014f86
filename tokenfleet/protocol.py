"""The wire protocol: key names, the request schema, reply events, encode/decode, validation.

No I/O here. ``docs/PROTOCOL.md`` is the human-readable contract; keep the two in step.

Requests are stream entries whose body is either one field ``m`` holding a msgpack map, or plain
string fields (``redis-cli XADD key * v 1 id abc prompt hello``). Reply events are stream entries
with a plain ``type`` field and an ``m`` field holding a msgpack map. Nothing read from Redis is
unpickled or evaluated: msgpack and JSON decode data, never code.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

from tokenfleet.errors import ProtocolError

PROTOCOL_VERSION = 1
"""The only request version this release reads. A bump means an incompatible change."""

GROUP = "workers"
"""Consumer group every worker joins on every request stream."""

AUTO_BUCKET = "auto"
"""Pseudo-bucket of the ingress stream for producers that cannot tokenize."""

BODY_FIELD = b"m"
"""Stream field that holds a msgpack body (requests and reply events)."""

# Size limits on what a request may carry; the worker's own caps (max_seq_len, max_new_tokens) apply on top.
MAX_ID_LEN = 128
MAX_PROMPT_BYTES = 1 << 20
MAX_INPUT_IDS = 1 << 17
MAX_NEW_TOKENS_CAP = 1 << 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 256
MAX_ROLE_LEN = 32
MAX_REPLY_TTL_S = 7 * 24 * 3600
DEFAULT_REPLY_TTL_S = 24 * 3600
# An error reply to a request whose own reply_ttl_s cannot be read (an undecodable entry)
ERROR_REPLY_TTL_S = 3600
# The dead-letter stream keeps about this many entries, each with at most this much of the body
DEAD_LETTER_MAXLEN = 10_000
DEAD_LETTER_BODY_BYTES = 4096
DEFAULT_MAX_NEW_TOKENS = 64
MAX_BODY_BYTES = 4 << 20
# Deepest nesting of lists and maps a request may hold (the protocol's own fields need 2: a map of
# lists); a deeper entry is undecodable before anything walks it, so no code recursing over it
# (JSON's parser, msgpack's packer, a repr) can blow the stack of the worker that took it
MAX_NESTING = 8

_ID_RE = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_ID_LEN}}}")  # fullmatch: no newline slips past a "$"
# plain-form numbers: ASCII digits only (int() takes "٣", "1_0" and " 5 ")
_PLAIN_INT_RE = re.compile(r"-?[0-9]{1,20}")
_PLAIN_FLOAT_RE = re.compile(r"-?(?:[0-9]{1,20}(?:\.[0-9]{0,20})?|\.[0-9]{1,20})(?:[eE][-+]?[0-9]{1,4})?")


def smallest_bucket(buckets: Iterable[int], prompt_len: int) -> int | None:
    """The smallest bucket that holds ``prompt_len`` tokens, or None if every bucket is shorter:
    the one routing rule, shared by producers, the ``auto`` stream and the worker's admission."""
    return min((b for b in buckets if prompt_len <= b), default=None)


class ErrorCode:
    """Stable machine-readable codes carried by ``error`` events. Never rename one."""

    INVALID_REQUEST = "invalid_request"  # a field has the wrong type or is out of range
    PROMPT_TOO_LONG = "prompt_too_long"  # longer than the largest bucket served
    MAX_SEQ_LEN_EXCEEDED = "max_seq_len_exceeded"  # prompt + max_new_tokens > max_seq_len
    UNSUPPORTED_VERSION = "unsupported_version"  # protocol version this worker does not speak
    UNDECODABLE = "undecodable"  # the body is not msgpack / not a map / not UTF-8
    CACHE_TOO_SMALL = "cache_too_small"  # the request could never fit in the worker's KV cache
    DUPLICATE_ID = "duplicate_id"  # another request with this id is in flight or answered
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the request's deadline passed
    TOO_MANY_ATTEMPTS = "too_many_attempts"  # delivered too often without finishing
    INTERNAL = "internal_error"  # a bug or device failure while running the request


class FinishReason:
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Keys:
    """Every Redis key tokenfleet uses, derived from one prefix.

    Keys that workers touch together (the request streams, read in one XREADGROUP and one
    script; the backpressure hash the enqueue script reads beside a stream; the fleet registry)
    share the hash tag ``{prefix}``, so on Redis Cluster they live in one slot. Reply streams and
    cancel flags carry no tag, so they spread over every node.
    """

    prefix: str = "tokenfleet"

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "{}*?[] "):
            raise ValueError(
                f"prefix must be non-empty without braces, glob characters or spaces: {self.prefix!r}"
            )

    @property
    def tag(self) -> str:
        """Hash tag of the keys that must share a cluster slot."""
        return "{" + self.prefix + "}"

    def request_stream(self, bucket: int | str) -> str:
        """Stream of requests for prompts of at most ``bucket`` tokens (or ``auto``)."""
        return f"{self.tag}:req:{bucket}"

    @property
    def auto_stream(self) -> str:
        """Ingress stream for untokenized prompts; a worker moves each entry to its bucket."""
        return self.request_stream(AUTO_BUCKET)

    def reply_stream(self, request_id: str) -> str:
        """Per-request stream of ``token`` events and one terminal ``done``/``error`` event."""
        return f"{self.prefix}:reply:{request_id}"

    def client_wake(self, client_id: str) -> str:
        """A client's own stream: an entry ends the client's blocked XREAD over the reply streams
        it follows, so that the next read includes a stream it started following (expires)."""
        return f"{self.prefix}:client:{client_id}:wake"

    def owner(self, request_id: str) -> str:
        """The request stream entry that owns a request id (``stream entry-id``), set by the
        worker that takes it, kept as long as its reply stream: a second entry with the same id
        is refused (``duplicate_id``), never merged into the first one's replies."""
        return f"{self.prefix}:owner:{request_id}"

    def cancel(self, request_id: str) -> str:
        """Exists (any value, with a TTL) when a request is cancelled; checked when a worker takes it."""
        return f"{self.prefix}:cancel:{request_id}"

    @property
    def cancels(self) -> str:
        """Stream of cancelled request ids (field ``id``), read by every worker each turn."""
        return f"{self.tag}:cancels"

    @property
    def dead_letter(self) -> str:
        """Stream of entries that could not be decoded or failed too many times, with the reason."""
        return f"{self.tag}:dead"

    @property
    def max_queue(self) -> str:
        """Hash of bucket -> most entries that may wait undelivered on its stream (backpressure)."""
        return f"{self.tag}:max_queue"

    @property
    def buckets(self) -> str:
        """Set of bucket sizes that live workers serve; producers route by it."""
        return f"{self.tag}:buckets"

    @property
    def workers(self) -> str:
        """Hash of worker name -> msgpack heartbeat (buckets, device, last seen)."""
        return f"{self.tag}:workers"

    @property
    def patterns(self) -> tuple[str, str]:
        """SCAN/ACL glob patterns that cover every key of this prefix."""
        return f"{self.tag}:*", f"{self.prefix}:*"


@dataclass(frozen=True)
class Request:
    """One generation request as it travels on a request stream."""

    id: str
    prompt: str | None = None
    input_ids: tuple[int, ...] | None = None
    # chat: ((role, content), ...), rendered by the worker with the model's chat template
    messages: tuple[tuple[str, str], ...] | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    deadline_ms: int | None = None
    reply_ttl_s: int = DEFAULT_REPLY_TTL_S
    # when Redis first accepted it (Unix ms), set by the worker that moves an ``auto`` entry to
    # its bucket: the queue time and the max_wait_ms window count from there, not from the move
    enqueued_ms: int | None = None
    v: int = PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-ready map of this request, without defaults' noise."""
        # the fields are flat: no deep copy (``asdict`` made one per prompt token, ~1 us each)
        values = ((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "extra")
        body = {k: v for k, v in values if v is not None}
        for k in ("input_ids", "stop", "stop_token_ids"):
            if k in body:
                body[k] = list(body[k])
        if self.messages is not None:
            body["messages"] = [{"role": role, "content": content} for role, content in self.messages]
        if not body["stop"]:
            del body["stop"]
        if not body["stop_token_ids"]:
            del body["stop_token_ids"]
        return body


# -- validation -------------------------------------------------------------------------------------

_INT_FIELDS = {
    "v": (0, 1 << 31),
    "max_new_tokens": (1, MAX_NEW_TOKENS_CAP),
    "top_k": (0, 1 << 31),
    "seed": (0, (1 << 63) - 1),
    "deadline_ms": (0, 1 << 53),
    "reply_ttl_s": (1, MAX_REPLY_TTL_S),
    "enqueued_ms": (0, 1 << 53),
}
_FLOAT_FIELDS = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0)}
_KNOWN = (
    set(_INT_FIELDS)
    | set(_FLOAT_FIELDS)
    | {
        "id",
        "prompt",
        "input_ids",
        "messages",
        "stop",
        "stop_token_ids",
        "ignore_eos",
    }
)


def _bad(rid: str | None, message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_REQUEST, message, request_id=rid)


def _as_int(rid: str | None, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(rid, f"{name} must be an integer, got {type(value).__name__}")
    lo, hi = _INT_FIELDS[name]
    if not lo <= value <= hi:
        raise _bad(rid, f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _as_float(rid: str | None, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(rid, f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    lo, hi = _FLOAT_FIELDS[name]
    if not (math.isfinite(value) and lo <= value <= hi):
        raise _bad(rid, f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _as_int_list(rid: str | None, name: str, value: Any, max_len: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise _bad(rid, f"{name} must be a list of integers")
    if len(value) > max_len:
        raise _bad(rid, f"{name} holds {len(value)} items; at most {max_len} allowed")
    # checked in C (a Python loop per item took ~0.7 ms of the worker's loop for a 4k-token
    # prompt); ``type(x) is int`` also turns away bools, which msgpack's true/false become
    if value and (set(map(type, value)) != {int} or min(value) < 0 or max(value) >= 1 << 31):
        raise _bad(rid, f"{name} must hold integers in [0, 2^31)")
    return tuple(value)


def _as_messages(rid: str | None, value: Any) -> tuple[tuple[str, str], ...]:
    """OpenAI-style chat messages: a list of maps with a string ``role`` and ``content``."""
    if not isinstance(value, (list, tuple)) or not 0 < len(value) <= MAX_MESSAGES:
        raise _bad(rid, f"messages must be a list of 1-{MAX_MESSAGES} maps with role and content")
    pairs = []
    for message in value:
        if not isinstance(message, dict):
            raise _bad(rid, "each message must be a map with role and content")
        role, content = message.get("role"), message.get("content")
        if not (isinstance(role, str) and 0 < len(role) <= MAX_ROLE_LEN and isinstance(content, str)):
            raise _bad(rid, f"each message needs a role (1-{MAX_ROLE_LEN} characters) and a string content")
        pairs.append((role, content))
    if sum(len(c.encode("utf-8", "surrogatepass")) for _, c in pairs) > MAX_PROMPT_BYTES:
        raise _bad(rid, f"messages hold more than {MAX_PROMPT_BYTES} bytes of content")
    return tuple(pairs)


def valid_request_id(value: object) -> bool:
    """Whether ``value`` is a request id as PROTOCOL.md defines it (usable as a reply key)."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def _request_id(body: dict[str, Any]) -> str | None:
    """The request id if it is usable as a reply key, else None."""
    rid = body.get("id")
    return rid if valid_request_id(rid) else None


def validate_request(body: dict[str, Any]) -> Request:
    """Check every field of a decoded request map and build a :class:`Request`.

    Raises :class:`ProtocolError`: ``dead_letter`` is set when no reply can be sent (no valid id)
    or the version is unknown; otherwise the error belongs in an ``error`` reply.
    Unknown fields are kept in ``extra`` and otherwise ignored, so that minor additions to the
    protocol do not break older workers.
    """
    rid = _request_id(body)
    if rid is None:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            f"id must be a string of 1-{MAX_ID_LEN} characters from [A-Za-z0-9._:-]",
            dead_letter=True,
        )
    version = body.get("v", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version!r} is not supported (this worker speaks {PROTOCOL_VERSION})",
            request_id=rid,
            dead_letter=True,
        )
    kw: dict[str, Any] = {"id": rid}
    prompt, input_ids, messages = body.get("prompt"), body.get("input_ids"), body.get("messages")
    if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
        raise _bad(rid, "exactly one of prompt, input_ids and messages is required")
    if messages is not None:
        kw["messages"] = _as_messages(rid, messages)
    elif prompt is not None:
        if not isinstance(prompt, str):
            raise _bad(rid, "prompt must be a string")
        if len(prompt.encode("utf-8", "surrogatepass")) > MAX_PROMPT_BYTES:
            raise _bad(rid, f"prompt is larger than {MAX_PROMPT_BYTES} bytes")
        if not prompt:
            raise _bad(rid, "prompt is empty")
        kw["prompt"] = prompt
    else:
        ids = _as_int_list(rid, "input_ids", input_ids, MAX_INPUT_IDS)
        if not ids:
            raise _bad(rid, "input_ids is empty")
        kw["input_ids"] = ids
    for name in _INT_FIELDS:
        if name in body and body[name] is not None and name != "v":
            kw[name] = _as_int(rid, name, body[name])
    for name in _FLOAT_FIELDS:
        if name in body and body[name] is not None:
            kw[name] = _as_float(rid, name, body[name])
    if kw.get("top_p", 1.0) == 0.0:
        raise _bad(rid, "top_p must be > 0")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_STRINGS:
            raise _bad(rid, f"stop must be a list of at most {MAX_STOP_STRINGS} strings")
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN for s in stop):
            raise _bad(rid, f"each stop string must be 1-{MAX_STOP_STRING_LEN} characters")
        kw["stop"] = tuple(stop)
    if body.get("stop_token_ids") is not None:
        kw["stop_token_ids"] = _as_int_list(rid, "stop_token_ids", body["stop_token_ids"], MAX_STOP_TOKEN_IDS)
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise _bad(rid, "ignore_eos must be a boolean")
        kw["ignore_eos"] = body["ignore_eos"]
    kw["extra"] = {k: v for k, v in body.items() if k not in _KNOWN}
    return Request(**kw)


# -- request codec ----------------------------------------------------------------------------------


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def unpack(data: bytes) -> Any:
    """Decode msgpack data from Redis: plain data only, bounded sizes and nesting (msgpack's own
    stack stops at 1,024; :data:`MAX_NESTING` is ours), no extension types."""
    if len(data) > MAX_BODY_BYTES:
        raise ValueError(f"body is larger than {MAX_BODY_BYTES} bytes")
    obj = msgpack.unpackb(data, raw=False, ext_hook=_reject_ext, strict_map_key=True, timestamp=0)
    check_nesting(obj)
    return obj


def check_nesting(obj: Any, limit: int = MAX_NESTING) -> None:
    """Raise ``ValueError`` if lists and maps nest deeper than ``limit``; iterative (a recursive
    walk is what a deep entry would break), and it only descends into containers, so a flat list
    of 100k token ids costs one pass in C."""
    if not isinstance(obj, (list, tuple, dict)):
        return
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        kinds = set(map(type, children))
        if not kinds & {list, tuple, dict}:
            continue
        if depth >= limit:
            raise ValueError(f"lists and maps nest deeper than {limit}")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (list, tuple, dict)))


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _plain_value(name: str, raw: str) -> Any:
    """Parse one plain-string field of a ``redis-cli XADD`` request by the schema's type: exactly
    the forms PROTOCOL.md gives (ASCII decimal numbers, JSON arrays nested at most
    :data:`MAX_NESTING` deep); anything else stays a string, which validation then refuses."""
    if name in _INT_FIELDS:
        return int(raw) if _PLAIN_INT_RE.fullmatch(raw) else raw
    if name in _FLOAT_FIELDS:
        return float(raw) if _PLAIN_FLOAT_RE.fullmatch(raw) else raw
    if name in ("input_ids", "stop", "stop_token_ids", "messages"):
        if raw.count("[") + raw.count("{") > MAX_NESTING:
            _check_json_nesting(raw)  # only then can it be too deep: flat arrays skip the scan
        try:
            value = json.loads(raw)  # JSON arrays: data only, never evaluated
        except ValueError:
            return raw
        check_nesting(value)
        return value
    if name == "ignore_eos":
        return {"true": True, "1": True, "false": False, "0": False}.get(raw.lower(), raw)
    return raw


def _check_json_nesting(raw: str) -> None:
    """Raise ``ValueError`` if a JSON text's brackets nest deeper than :data:`MAX_NESTING`,
    before the parser (which recurses) sees it."""
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


def decode_request_body(fields: dict[bytes, bytes]) -> dict[str, Any]:
    """Turn a request stream entry's fields into a plain map (not yet validated).

    Raises :class:`ProtocolError` with ``dead_letter`` set if the body cannot be decoded.
    """
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
    # RecursionError and MemoryError too: nothing an entry holds may escape its own error path
    except (
        ValueError,
        TypeError,
        UnicodeDecodeError,
        msgpack.UnpackException,
        RecursionError,
        MemoryError,
    ) as e:
        raise ProtocolError(
            ErrorCode.UNDECODABLE, f"cannot decode request body: {e}", dead_letter=True
        ) from e


def decode_request(fields: dict[bytes, bytes]) -> Request:
    """Decode and validate a request stream entry (see :func:`validate_request`)."""
    body = decode_request_body(fields)
    try:
        return validate_request(body)
    except ProtocolError as e:
        if e.request_id is None and not e.dead_letter:
            e.request_id = _request_id(body)
        raise


def encode_request(request: Request) -> dict[bytes, bytes]:
    """Stream fields of a request in the msgpack form."""
    return {BODY_FIELD: pack(request.to_wire())}


def salvage_reply(fields: dict[bytes, bytes]) -> tuple[str | None, int]:
    """Where an error reply to an entry that will not run goes, from one decode of it: the
    request id if one can be read (else None), and the reply TTL, the request's own
    ``reply_ttl_s`` where the entry decodes and it is valid, else :data:`ERROR_REPLY_TTL_S`.
    Never raises, whatever the entry holds."""
    try:
        body: Any = decode_request_body(fields)
    except Exception:  # noqa: BLE001 (the salvage of a broken entry must not break in turn)
        body = None
    ttl = ERROR_REPLY_TTL_S
    if body is not None:
        value = body.get("reply_ttl_s", DEFAULT_REPLY_TTL_S)
        lo, hi = _INT_FIELDS["reply_ttl_s"]
        if isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi:
            ttl = value
        return _request_id(body), ttl
    try:  # a msgpack body whose other strings are not UTF-8 (a prompt, say) still names its id
        data = fields[BODY_FIELD]
        if len(data) <= MAX_BODY_BYTES:
            lenient = msgpack.unpackb(data, raw=False, unicode_errors="surrogateescape", ext_hook=_reject_ext)
            check_nesting(lenient)
            rid = _request_id(lenient) if isinstance(lenient, dict) else None
            if rid is not None:
                return rid, ttl
    except Exception:  # noqa: BLE001 (no id there: try the plain form's field)
        pass
    raw = fields.get(b"id") if isinstance(fields, dict) else None
    if isinstance(raw, bytes) and len(raw) <= MAX_ID_LEN:
        try:
            return _request_id({"id": raw.decode("utf-8")}), ttl
        except UnicodeDecodeError:
            pass
    return None, ttl


def salvage_request_id(fields: dict[bytes, bytes]) -> str | None:
    """Best-effort request id from an entry that failed to decode (see :func:`salvage_reply`)."""
    return salvage_reply(fields)[0]


# -- backpressure ---------------------------------------------------------------------------------

ENQUEUE_SCRIPT = """
-- KEYS[1] request stream, KEYS[2] the max_queue hash; ARGV[1] bucket, ARGV[2] msgpack body.
-- Adds the request unless the stream already holds max_queue entries no worker has taken yet.
local limit = tonumber(redis.call('HGET', KEYS[2], ARGV[1]))
if limit then
  local depth = redis.call('XLEN', KEYS[1])
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
  if ok then
    for _, g in ipairs(groups) do
      for i = 1, #g, 2 do
        if g[i] == 'name' and g[i + 1] ~= 'workers' then break end
        if g[i] == 'lag' and g[i + 1] then depth = g[i + 1] end
      end
    end
  end
  if depth >= limit then
    return redis.error_reply('QUEUEFULL ' .. KEYS[1] .. ' holds ' .. depth ..
                             ' waiting requests (max_queue ' .. limit .. ')')
  end
end
return redis.call('XADD', KEYS[1], '*', 'm', ARGV[2])
"""
"""Atomic "XADD unless the queue is full" for producers (see PROTOCOL.md, Backpressure)."""


# -- reply events -----------------------------------------------------------------------------------


class EventType:
    TOKEN = "token"
    DONE = "done"
    ERROR = "error"


TERMINAL_EVENTS = (EventType.DONE, EventType.ERROR)

TERMINAL_EVENT_ID = "1-0"
"""Stream id of every terminal event. Reply events carry explicit ids (token ``i`` is ``0-{i+1}``)
so that Redis itself refuses a second copy of any event: a retried write, a redelivered request
or a second worker racing on the same request can never duplicate a token or a terminal event."""


def event_id(event: dict[str, Any]) -> str:
    """The reply-stream id an event must be written at (see :data:`TERMINAL_EVENT_ID`)."""
    if event["type"] == EventType.TOKEN:
        return f"0-{event['index'] + 1}"
    return TERMINAL_EVENT_ID


def is_duplicate_event_error(error: Exception) -> bool:
    """Whether Redis refused an XADD because that event id is already on the stream."""
    return "equal or smaller than the target stream top item" in str(error)


def token_event(index: int, token_ids: list[int], text: str) -> dict[str, Any]:
    """``index`` is the position of the first of ``token_ids`` among the generated tokens."""
    return {"type": EventType.TOKEN, "index": index, "ids": token_ids, "text": text}


def done_event(
    finish_reason: str, prompt_tokens: int, completion_tokens: int, timings: dict[str, float], batch_size: int
) -> dict[str, Any]:
    return {
        "type": EventType.DONE,
        "finish_reason": finish_reason,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
        "timings": timings,
        "batch_size": batch_size,
    }


def error_event(code: str, message: str) -> dict[str, Any]:
    return {"type": EventType.ERROR, "code": code, "message": message}


def encode_event(event: dict[str, Any]) -> dict[bytes, bytes]:
    return {b"type": event["type"].encode(), BODY_FIELD: pack(event)}


def decode_event(fields: dict[bytes, bytes]) -> dict[str, Any]:
    event = unpack(fields[BODY_FIELD])
    if not isinstance(event, dict) or "type" not in event:
        raise ProtocolError(ErrorCode.UNDECODABLE, "reply event is not a map with a type")
    return event
