"""The wire protocol: key names, the request, typed reply events, the codec, validation. No I/O.

``docs/PROTOCOL.md`` is the human-readable contract; keep the two in step. Requests are stream
entries whose body is one field ``m`` holding a msgpack map, or plain string fields
(``redis-cli XADD key * v 1 id abc prompt hello``). Reply events are typed
(:class:`TokenEvent`, :class:`DoneEvent`, :class:`ErrorEvent`).
"""

from tokenfleet.protocol.codec import (
    Fields,
    as_text,
    check_nesting,
    decode_request,
    decode_request_body,
    encode_request,
    pack,
    salvage_reply,
    unpack,
)
from tokenfleet.protocol.constants import (
    AUTO_BUCKET,
    BODY_FIELD,
    DEAD_LETTER_BODY_BYTES,
    DEAD_LETTER_MAXLEN,
    DEFAULT_LANE,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_REPLY_TTL_S,
    ERROR_REPLY_TTL_S,
    GROUP,
    LANES,
    MAX_BODY_BYTES,
    MAX_ID_LEN,
    MAX_INPUT_IDS,
    MAX_NESTING,
    MAX_NEW_TOKENS_CAP,
    MAX_PROMPT_BYTES,
    MAX_REPLY_TTL_S,
    PROTOCOL_VERSION,
    TERMINAL_EVENTS,
    ErrorCode,
    EventType,
    FinishReason,
)
from tokenfleet.protocol.events import (
    TERMINAL_EVENT_ID,
    DoneEvent,
    ErrorEvent,
    ReplyEvent,
    TokenEvent,
    TokenLogprob,
    decode_event,
    encode_event,
    is_duplicate_event_error,
)
from tokenfleet.protocol.heartbeat import STALE_AFTER_S, parse_heartbeat
from tokenfleet.protocol.keys import Keys
from tokenfleet.protocol.output_controls import ResponseFormat
from tokenfleet.protocol.refusal import Refusal
from tokenfleet.protocol.request import Request, smallest_bucket
from tokenfleet.protocol.validation import valid_request_id, valid_tenant, valid_traceparent, validate_request

__all__ = [
    "AUTO_BUCKET",
    "BODY_FIELD",
    "DEAD_LETTER_BODY_BYTES",
    "DEAD_LETTER_MAXLEN",
    "DEFAULT_LANE",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_REPLY_TTL_S",
    "ERROR_REPLY_TTL_S",
    "GROUP",
    "LANES",
    "MAX_BODY_BYTES",
    "MAX_ID_LEN",
    "MAX_INPUT_IDS",
    "MAX_NESTING",
    "MAX_NEW_TOKENS_CAP",
    "MAX_PROMPT_BYTES",
    "MAX_REPLY_TTL_S",
    "PROTOCOL_VERSION",
    "STALE_AFTER_S",
    "TERMINAL_EVENTS",
    "TERMINAL_EVENT_ID",
    "DoneEvent",
    "ErrorCode",
    "ErrorEvent",
    "EventType",
    "Fields",
    "FinishReason",
    "Keys",
    "Refusal",
    "ReplyEvent",
    "Request",
    "TokenEvent",
    "TokenLogprob",
    "ResponseFormat",
    "as_text",
    "check_nesting",
    "decode_event",
    "decode_request",
    "decode_request_body",
    "encode_event",
    "encode_request",
    "is_duplicate_event_error",
    "pack",
    "parse_heartbeat",
    "salvage_reply",
    "smallest_bucket",
    "unpack",
    "valid_request_id",
    "valid_tenant",
    "valid_traceparent",
    "validate_request",
]
