"""Checking every field of a decoded request map: types, ranges and sizes, with stable codes."""

from __future__ import annotations

import math
import re
from typing import Any

from tokenfleet.errors import ProtocolError
from tokenfleet.protocol.affinity import MAX_CACHE_KEY_LEN
from tokenfleet.protocol.constants import (
    DEFAULT_MAX_NEW_TOKENS,
    LANES,
    MAX_ADAPTER_NAME_LEN,
    MAX_ID_LEN,
    MAX_INPUT_IDS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_NEW_TOKENS_CAP,
    MAX_PROMPT_BYTES,
    MAX_REPLY_TTL_S,
    MAX_ROLE_LEN,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TENANT_LEN,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    ErrorCode,
)
from tokenfleet.protocol.embed import parse_embed
from tokenfleet.protocol.output_controls import parse_logit_bias, parse_response_format
from tokenfleet.protocol.request import Request

INT_FIELDS = {
    "v": (0, 1 << 31),
    "max_new_tokens": (1, MAX_NEW_TOKENS_CAP),
    "top_k": (0, 1 << 31),
    "seed": (0, (1 << 63) - 1),
    "deadline_ms": (0, 1 << 53),
    "reply_ttl_s": (1, MAX_REPLY_TTL_S),
    "enqueued_ms": (0, 1 << 53),
    "min_tokens": (0, MAX_NEW_TOKENS_CAP),
    "logprobs": (0, MAX_LOGPROBS),
}
"""Integer fields and their inclusive ranges."""
FLOAT_FIELDS = {
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 10.0),
}
"""Number fields and their inclusive ranges."""
LIST_FIELDS = ("input_ids", "stop", "stop_token_ids", "messages")
"""Fields that hold arrays (JSON arrays in the plain form)."""
MAP_FIELDS = ("response_format", "logit_bias", "embed")
"""Fields that hold maps (JSON objects in the plain form)."""
_KNOWN = {
    *INT_FIELDS,
    *FLOAT_FIELDS,
    *LIST_FIELDS,
    *MAP_FIELDS,
    "id",
    "prompt",
    "ignore_eos",
    "priority",
    "cache_key",
    "adapter",
    "traceparent",
    "tenant",
}

_TENANT_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:\-]{{0,{MAX_TENANT_LEN - 1}}}")
_TRACEPARENT_RE = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_ID_RE = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_ID_LEN}}}")  # fullmatch: no newline slips past a "$"
_ADAPTER_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:/\-]{{0,{MAX_ADAPTER_NAME_LEN - 1}}}")


def valid_tenant(value: object) -> bool:
    """Whether ``value`` is a tenant name as PROTOCOL.md defines it."""
    return isinstance(value, str) and _TENANT_RE.fullmatch(value) is not None


def valid_traceparent(value: object) -> bool:
    """A version-00 W3C ``traceparent`` whose ids are not all zeros."""
    if not isinstance(value, str) or _TRACEPARENT_RE.fullmatch(value) is None:
        return False
    _, trace_id, span_id, _ = value.split("-")
    return trace_id != "0" * 32 and span_id != "0" * 16


def valid_adapter_name(value: object) -> bool:
    """Whether ``value`` is an adapter name as PROTOCOL.md defines it."""
    return isinstance(value, str) and _ADAPTER_RE.fullmatch(value) is not None


def valid_request_id(value: object) -> bool:
    """Whether ``value`` is a request id as PROTOCOL.md defines it (usable as a reply key)."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def request_id_of(body: dict[str, Any]) -> str | None:
    """The map's request id if it is usable as a reply key, else None."""
    rid = body.get("id")
    return rid if isinstance(rid, str) and valid_request_id(rid) else None


def validate_request(body: dict[str, Any]) -> Request:
    """Check every field of a decoded request map and build a :class:`Request`.

    Raises :class:`ProtocolError`: with ``dead_letter`` when no reply can be sent (no valid id) or
    the version is unknown; otherwise naming the request id its ``error`` reply goes to. Unknown
    fields are kept in ``extra`` and otherwise ignored, so that additions to the protocol do not
    break older workers.
    """
    rid = request_id_of(body)
    if rid is None:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            f"id must be a string of 1-{MAX_ID_LEN} characters from [A-Za-z0-9._:-]",
            dead_letter=True,
        )
    version = body.get("v", PROTOCOL_VERSION)
    if version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version!r} is not supported (this worker speaks "
            f"{' and '.join(map(str, SUPPORTED_VERSIONS))})",
            request_id=rid,
            dead_letter=True,
        )
    return _Fields(rid, body).request()


class _Fields:
    """The field checks of one request map, each raising an ``invalid_request`` for its id."""

    def __init__(self, rid: str, body: dict[str, Any]):
        self.rid, self.body = rid, body

    def bad(self, message: str) -> ProtocolError:
        return ProtocolError(ErrorCode.INVALID_REQUEST, message, request_id=self.rid)

    def request(self) -> Request:
        body = self.body
        kw: dict[str, Any] = {"id": self.rid, **self.input()}
        for name in INT_FIELDS:
            if body.get(name) is not None and name != "v":
                kw[name] = self.integer(name, body[name])
        for name in FLOAT_FIELDS:
            if body.get(name) is not None:
                kw[name] = self.number(name, body[name])
        if kw.get("top_p", 1.0) == 0.0:
            raise self.bad("top_p must be > 0")
        if kw.get("repetition_penalty", 1.0) == 0.0:
            raise self.bad("repetition_penalty must be > 0")
        if kw.get("min_tokens", 0) > kw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS):
            raise self.bad("min_tokens must not exceed max_new_tokens")
        try:
            if body.get("response_format") is not None:
                kw["response_format"] = parse_response_format(body["response_format"])
            if body.get("logit_bias") is not None:
                kw["logit_bias"] = parse_logit_bias(body["logit_bias"])
        except ValueError as e:
            raise self.bad(str(e)) from None
        if body.get("stop") is not None:
            kw["stop"] = self.stop_strings(body["stop"])
        if body.get("stop_token_ids") is not None:
            kw["stop_token_ids"] = self.int_list("stop_token_ids", body["stop_token_ids"], MAX_STOP_TOKEN_IDS)
        if body.get("ignore_eos") is not None:
            if not isinstance(body["ignore_eos"], bool):
                raise self.bad("ignore_eos must be a boolean")
            kw["ignore_eos"] = body["ignore_eos"]
        if body.get("priority") is not None:
            if body["priority"] not in LANES:
                raise self.bad(f"priority must be one of {', '.join(LANES)}")
            kw["priority"] = body["priority"]
        if body.get("cache_key") is not None:
            key = body["cache_key"]
            if not (isinstance(key, str) and 0 < len(key) <= MAX_CACHE_KEY_LEN):
                raise self.bad(f"cache_key must be a string of 1-{MAX_CACHE_KEY_LEN} characters")
            kw["cache_key"] = key
        if body.get("adapter") is not None:
            if not valid_adapter_name(body["adapter"]):
                raise self.bad(
                    f"adapter must be a name of 1-{MAX_ADAPTER_NAME_LEN} characters from [A-Za-z0-9._:/-], "
                    "starting with a letter or digit"
                )
            kw["adapter"] = body["adapter"]
        if body.get("tenant") is not None:
            if not valid_tenant(body["tenant"]):
                raise self.bad(
                    f"tenant must be a name of 1-{MAX_TENANT_LEN} characters from [A-Za-z0-9._:-], "
                    "starting with a letter or digit"
                )
            kw["tenant"] = body["tenant"]
        if body.get("traceparent") is not None:
            if not valid_traceparent(body["traceparent"]):
                raise self.bad("traceparent must be a W3C traceparent: 00-<32 hex>-<16 hex>-<2 hex>")
            kw["traceparent"] = body["traceparent"]
        if body.get("embed") is not None:
            kw["embed"] = self.embed(body["embed"], kw)
        kw["extra"] = {k: v for k, v in body.items() if k not in _KNOWN}
        return Request(**kw)

    def embed(self, value: Any, kw: dict[str, Any]) -> Any:
        """An embedding request: its spec, with nothing that shapes generated text."""
        try:
            spec = parse_embed(value)
        except ValueError as e:
            raise self.bad(str(e)) from None
        if "messages" in kw:
            raise self.bad("embed takes prompt or input_ids, not messages")
        generation_only = ("response_format", "logprobs", "adapter", "logit_bias")
        clashing = [k for k in generation_only if kw.get(k) not in (None, ())]
        if clashing:
            raise self.bad(f"{clashing[0]} does not apply to an embedding request")
        return spec

    def input(self) -> dict[str, Any]:
        """Exactly one of ``prompt``, ``input_ids`` and ``messages``."""
        prompt, input_ids, messages = (self.body.get(k) for k in ("prompt", "input_ids", "messages"))
        if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
            raise self.bad("exactly one of prompt, input_ids and messages is required")
        if messages is not None:
            return {"messages": self.messages(messages)}
        if prompt is not None:
            if not isinstance(prompt, str):
                raise self.bad("prompt must be a string")
            if len(prompt.encode("utf-8", "surrogatepass")) > MAX_PROMPT_BYTES:
                raise self.bad(f"prompt is larger than {MAX_PROMPT_BYTES} bytes")
            if not prompt:
                raise self.bad("prompt is empty")
            return {"prompt": prompt}
        ids = self.int_list("input_ids", input_ids, MAX_INPUT_IDS)
        if not ids:
            raise self.bad("input_ids is empty")
        return {"input_ids": ids}

    def integer(self, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(f"{name} must be an integer, got {type(value).__name__}")
        lo, hi = INT_FIELDS[name]
        if not lo <= value <= hi:
            raise self.bad(f"{name} must be in [{lo}, {hi}], got {value}")
        return value

    def number(self, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.bad(f"{name} must be a number, got {type(value).__name__}")
        number = float(value)
        lo, hi = FLOAT_FIELDS[name]
        if not (math.isfinite(number) and lo <= number <= hi):
            raise self.bad(f"{name} must be in [{lo}, {hi}], got {number}")
        return number

    def int_list(self, name: str, value: Any, max_len: int) -> tuple[int, ...]:
        if not isinstance(value, (list, tuple)):
            raise self.bad(f"{name} must be a list of integers")
        if len(value) > max_len:
            raise self.bad(f"{name} holds {len(value)} items; at most {max_len} allowed")
        # checked in C, not a Python loop per item; ``type(x) is int`` turns msgpack's booleans away
        if value and (set(map(type, value)) != {int} or min(value) < 0 or max(value) >= 1 << 31):
            raise self.bad(f"{name} must hold integers in [0, 2^31)")
        return tuple(value)

    def stop_strings(self, stop: Any) -> tuple[str, ...]:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_STRINGS:
            raise self.bad(f"stop must be a list of at most {MAX_STOP_STRINGS} strings")
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN for s in stop):
            raise self.bad(f"each stop string must be 1-{MAX_STOP_STRING_LEN} characters")
        return tuple(stop)

    def messages(self, value: Any) -> tuple[tuple[str, str], ...]:
        """OpenAI-style chat messages: a list of maps with a string ``role`` and ``content``."""
        if not isinstance(value, (list, tuple)) or not 0 < len(value) <= MAX_MESSAGES:
            raise self.bad(f"messages must be a list of 1-{MAX_MESSAGES} maps with role and content")
        pairs = []
        for message in value:
            if not isinstance(message, dict):
                raise self.bad("each message must be a map with role and content")
            role, content = message.get("role"), message.get("content")
            if not (isinstance(role, str) and 0 < len(role) <= MAX_ROLE_LEN and isinstance(content, str)):
                raise self.bad(
                    f"each message needs a role (1-{MAX_ROLE_LEN} characters) and a string content"
                )
            pairs.append((role, content))
        if sum(len(c.encode("utf-8", "surrogatepass")) for _, c in pairs) > MAX_PROMPT_BYTES:
            raise self.bad(f"messages hold more than {MAX_PROMPT_BYTES} bytes of content")
        return tuple(pairs)
