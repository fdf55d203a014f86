"""The protocol's fixed names and numbers: version, group, limits, error codes, finish reasons.

Everything here is part of the wire contract (docs/PROTOCOL.md): rename nothing, add with care.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
"""The version of a request any worker reads: every field but the output controls."""
OUTPUT_CONTROLS_VERSION = 2
"""The version of a request that uses an output control (``response_format``, ``logprobs``, the
penalties, ``logit_bias``, ``min_tokens``): a worker too old to honour them refuses it
(``unsupported_version``) instead of ignoring them."""
ADAPTER_VERSION = 3
"""The version of a request that names an ``adapter`` (a LoRA fine-tune of the model): a worker too
old to apply it refuses it (``unsupported_version``) instead of answering from the base model."""
EMBED_VERSION = 4
"""The version of an embedding request (``embed``): a worker too old to embed refuses it
(``unsupported_version``) instead of generating text for it."""
TENANT_VERSION = 5
"""The version of a request that names its ``tenant``: a worker too old to keep tenants' prefix
caches apart refuses it (``unsupported_version``) instead of sharing them."""
SUPPORTED_VERSIONS = (
    PROTOCOL_VERSION,
    OUTPUT_CONTROLS_VERSION,
    ADAPTER_VERSION,
    EMBED_VERSION,
    TENANT_VERSION,
)

GROUP = "workers"
"""Consumer group every worker joins on every request stream."""

AUTO_BUCKET = "auto"
"""Pseudo-bucket of the ingress stream for producers that cannot tokenize."""

LANES = ("interactive", "batch")
"""Priority lanes, highest first. A request names its lane in ``priority`` (default the first);
each lane has its own request streams, so a flood of one never queues ahead of the other."""
DEFAULT_LANE = LANES[0]

BODY_FIELD = b"m"
"""Stream field that holds a msgpack body (requests and reply events)."""

# What one request may carry; a worker's own caps (max_seq_len, max_new_tokens) apply on top.
MAX_ID_LEN = 128
MAX_PROMPT_BYTES = 1 << 20
MAX_INPUT_IDS = 1 << 17
MAX_EMBED_DIMENSIONS = 1 << 16
MAX_NEW_TOKENS_CAP = 1 << 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 256
MAX_ROLE_LEN = 32
MAX_BODY_BYTES = 4 << 20
MAX_NESTING = 32
"""Deepest nesting of lists and maps in a request (its own fields need 2, a JSON schema in
``response_format`` more): a deeper entry is undecodable before anything recursive (JSON's
parser, a repr) walks it."""
MAX_LOGPROBS = 20
"""Most alternatives ``logprobs`` may ask for at each position (OpenAI's limit)."""
MAX_LOGIT_BIAS = 1024
MAX_ADAPTER_NAME_LEN = 128
MAX_TENANT_LEN = 64
MAX_GRAMMAR_BYTES = 64 << 10
"""Largest JSON schema (as JSON text), regex or Lark grammar a ``response_format`` may carry."""

DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_REPLY_TTL_S = 24 * 3600
MAX_REPLY_TTL_S = 7 * 24 * 3600
ERROR_REPLY_TTL_S = 3600
"""TTL of an error reply to an entry whose own ``reply_ttl_s`` cannot be read."""

DEAD_LETTER_MAXLEN = 10_000
"""The dead-letter stream keeps about this many entries..."""
DEAD_LETTER_BODY_BYTES = 4096
"""...each with at most this much of the refused entry's body."""


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
    INVALID_GRAMMAR = "invalid_grammar"  # a response_format the grammar engine cannot compile
    ADAPTER_UNAVAILABLE = "adapter_unavailable"  # an adapter the fleet does not know, or cannot load
    INTERNAL = "internal_error"  # a bug or device failure while running the request
    LOST = "lost"  # Redis lost part of the reply (restart without persistence, failover): readers say so


class FinishReason:
    """Why a ``done`` event ended a request."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"


class EventType:
    """The ``type`` of a reply event."""

    TOKEN = "token"
    DONE = "done"
    ERROR = "error"


TERMINAL_EVENTS = (EventType.DONE, EventType.ERROR)
