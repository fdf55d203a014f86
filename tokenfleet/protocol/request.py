"""One request as it travels on a request stream, and the routing rule by length.

A text prompt's length in tokens is bounded before it is tokenized: no token decodes to more
characters than the vocabulary's longest, so a text of ``C`` characters is at least
``C / max_token_chars`` tokens. A prompt too long for every bucket by that bound is refused
without tokenizing it, by the producers (the gateway) and the workers alike."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from tokenfleet.protocol.constants import (
    ADAPTER_VERSION,
    DEFAULT_LANE,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_REPLY_TTL_S,
    EMBED_VERSION,
    LANES,
    OUTPUT_CONTROLS_VERSION,
    PROTOCOL_VERSION,
    TENANT_VERSION,
)
from tokenfleet.protocol.embed import EmbedSpec
from tokenfleet.protocol.output_controls import ResponseFormat


@dataclass(frozen=True)
class Request:
    """A validated request (see :func:`tokenfleet.protocol.validate_request`)."""

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
    min_tokens: int = 0  # EOS and stop token ids are held back until this many tokens
    presence_penalty: float = 0.0  # OpenAI's: minus this from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count so far
    repetition_penalty: float = 1.0  # HF's: logits of prompt and generated tokens moved toward 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    response_format: ResponseFormat | None = None  # a grammar the output must match
    logprobs: int | None = None  # report each token's logprob and this many top alternatives
    deadline_ms: int | None = None
    reply_ttl_s: int = DEFAULT_REPLY_TTL_S
    # when Redis first accepted it (Unix ms), set by the worker that moves an ``auto`` entry to
    # its bucket: the queue time and the max_wait_ms window count from there, not from the move
    enqueued_ms: int | None = None
    priority: str = DEFAULT_LANE  # one of LANES
    cache_key: str | None = None  # affinity: requests sharing it go to one shard (protocol.affinity)
    adapter: str | None = None  # a LoRA adapter of the model, by the name the fleet knows it by
    embed: EmbedSpec | None = None  # the prompt's vector instead of generated text (protocol.embed)
    traceparent: str | None = None  # W3C trace context: workers record their spans under it
    tenant: str | None = None  # whose request: its prefix cache and affinity are that tenant's own
    v: int = PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property  # read per row per step: computed once (the request is frozen)
    def processes_logits(self) -> bool:
        """Whether its logits need more than temperature, top-k and top-p before sampling."""
        return any(getattr(self, k) != d for k, d in _CONTROL_DEFAULTS.items() if k != "logprobs")

    @property
    def adjusts_logits(self) -> bool:
        """Whether its logits need penalties, a bias or ``min_tokens`` (all but a grammar's mask)."""
        skip = ("logprobs", "response_format")
        return any(getattr(self, k) != d for k, d in _CONTROL_DEFAULTS.items() if k not in skip)

    @property
    def uses_output_controls(self) -> bool:
        """Whether any output control is asked for (the request then needs ``v`` 2)."""
        return self.processes_logits or self.logprobs is not None

    @property
    def new_tokens(self) -> int:
        """Tokens it may generate: none for an embedding."""
        return 0 if self.embed is not None else self.max_new_tokens

    @property
    def lane(self) -> int:
        """The lane's rank: 0 is the highest."""
        return LANES.index(self.priority)

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-ready map of this request, without defaults' noise."""
        # the fields are flat: no deep copy (``asdict`` made one per prompt token)
        values = ((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "extra")
        # fields at their defaults stay off the wire: older workers need not see them
        body = {k: v for k, v in values if v is not None and _CONTROL_DEFAULTS.get(k) != v}
        if self.uses_output_controls:
            body["v"] = max(self.v, OUTPUT_CONTROLS_VERSION)  # an older worker refuses, never ignores
        if self.adapter is not None:
            body["v"] = max(body["v"], ADAPTER_VERSION)  # never answered from the base by an older one
        if self.embed is not None:
            body["v"] = max(body["v"], EMBED_VERSION)  # never answered with text by an older one
            body["embed"] = self.embed.to_wire()
        if self.tenant is not None:
            body["v"] = max(body["v"], TENANT_VERSION)  # never served from another tenant's cache
        if self.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        if self.response_format is not None:
            body["response_format"] = self.response_format.to_wire()
        for k in ("input_ids", "stop", "stop_token_ids"):
            if k in body:
                body[k] = list(body[k])
        if self.messages is not None:
            body["messages"] = [{"role": role, "content": content} for role, content in self.messages]
        if not body["stop"]:
            del body["stop"]
        if not body["stop_token_ids"]:
            del body["stop_token_ids"]
        if body["priority"] == DEFAULT_LANE:  # older workers need not see it
            del body["priority"]
        return body


OUTPUT_CONTROLS = (
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "logprobs",
)
"""The request fields that change what comes back beyond its text (protocol ``v`` 2)."""
_CONTROL_DEFAULTS = {f.name: f.default for f in fields(Request) if f.name in OUTPUT_CONTROLS}


def smallest_bucket(buckets: Iterable[int], prompt_len: int) -> int | None:
    """The smallest bucket that holds ``prompt_len`` tokens, or None if every bucket is shorter:
    the one routing rule, shared by producers, the ``auto`` stream and the worker's admission."""
    return min((b for b in buckets if prompt_len <= b), default=None)


def max_token_chars(tokenizer: Any) -> int:
    """Most characters one token of ``tokenizer``'s vocabulary decodes to (``transformers`` or
    ``tokenizers``: both have ``get_vocab``)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max(1, longest + 1)  # +1: byte-level markers and word-boundary spaces


def cannot_fit(chars: int, largest_bucket: int, token_chars: int) -> bool:
    """Whether ``chars`` characters are more tokens than ``largest_bucket``, however tokenized."""
    return chars > largest_bucket * token_chars
