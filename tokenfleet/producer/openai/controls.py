"""OpenAI's output controls on both endpoints, as tokenfleet request fields, and logprobs back in
OpenAI's shapes: ``response_format``, ``logprobs`` / ``top_logprobs``, the penalties,
``logit_bias``, and vLLM's extensions (``min_tokens``, ``repetition_penalty``, ``top_k``,
``stop_token_ids``). No I/O.

A field a body may carry but this gateway does not honour is refused by name (HTTP 400 with its
``param``), never ignored; :data:`ACCEPTED_NO_EFFECT` are the ones that change no output.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from tokenfleet.protocol import TokenLogprob
from tokenfleet.protocol.affinity import MAX_CACHE_KEY_LEN
from tokenfleet.protocol.constants import MAX_LOGIT_BIAS, MAX_LOGPROBS
from tokenfleet.protocol.output_controls import parse_logit_bias, parse_response_format

ACCEPTED_NO_EFFECT = ("user", "metadata", "store", "prompt_cache_key", "safety_identifier")
"""Fields taken and kept out of the output: labels for the caller's own records, and
``prompt_cache_key`` (with ``user`` as its fallback), which becomes the request's affinity
``cache_key``: requests that share it reach the worker holding their prefix."""

Decode = Callable[[int], str]
"""A token id's text (the gateway's tokenizer), for OpenAI's ``token`` strings."""


def token_id_text(token_id: int) -> str:
    """A token's name where no tokenizer is at hand (vLLM's ``return_tokens_as_token_ids`` form)."""
    return f"token_id:{token_id}"


def decoder(tokenizer: Any | None) -> Decode:
    """Token texts from a ``tokenizers`` tokenizer (special tokens kept), else token id names."""
    if tokenizer is None:
        return token_id_text
    return lambda token_id: str(tokenizer.decode([token_id], skip_special_tokens=False))


class ControlFields(BaseModel):
    """The output controls both endpoints take (chat's ``logprobs`` is a flag and
    ``top_logprobs`` its count; completions' ``logprobs`` is the count)."""

    response_format: dict[str, Any] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    min_tokens: int | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=-1)
    stop_token_ids: list[int] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("response_format")
    @classmethod
    def compiles_as_a_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            parse_response_format(value)  # a ValueError names the problem, 400 on response_format
        return value

    @field_validator("logit_bias")
    @classmethod
    def token_ids_to_numbers(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None:
            parse_logit_bias(value)
        return value

    def control_params(self, logprobs: int | None) -> dict[str, Any]:
        """These fields as tokenfleet request fields (``logprobs``: the count asked for)."""
        params: dict[str, Any] = {}
        if self.response_format is not None and self.response_format.get("type") != "text":
            params["response_format"] = self.response_format
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        if self.logit_bias:
            params["logit_bias"] = self.logit_bias
        if self.top_k is not None and self.top_k > 0:
            params["top_k"] = self.top_k
        if self.stop_token_ids:
            params["stop_token_ids"] = self.stop_token_ids
        if logprobs is not None:
            params["logprobs"] = logprobs
        key = self.prompt_cache_key or getattr(self, "user", None)
        if key:  # a key longer than the protocol takes keeps its identity through a digest
            params["cache_key"] = (
                key if len(key) <= MAX_CACHE_KEY_LEN else hashlib.sha256(key.encode()).hexdigest()
            )
        return params


class ChatLogprobFields(BaseModel):
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def top_needs_logprobs(self) -> ChatLogprobFields:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionLogprobFields(BaseModel):
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def nothing_we_cannot_do(self) -> CompletionLogprobFields:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported (use n)")
        return self

    def logprobs_asked(self) -> int | None:
        return self.logprobs


def shaped_logprobs(
    chat: bool, logprobs: list[TokenLogprob] | None, ids: list[int], decode: Decode, offset: int | None
) -> dict[str, Any] | None:
    """A choice's ``logprobs`` in its endpoint's shape (None where none were asked for);
    ``offset``: characters before these tokens (None in a chunk, which does not know it)."""
    if logprobs is None:
        return None
    if chat:
        return chat_logprobs(logprobs, ids, decode)
    shaped = completion_logprobs(logprobs, ids, decode, offset or 0)
    if offset is None:
        del shaped["text_offset"]
    return shaped


def chat_logprobs(logprobs: list[TokenLogprob], ids: list[int], decode: Decode) -> dict[str, Any]:
    """Chat's ``choices[].logprobs`` (or a chunk's) for these tokens."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    content = [
        {**entry(token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for token, lp in zip(ids, logprobs)
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    logprobs: list[TokenLogprob], ids: list[int], decode: Decode, offset: int = 0
) -> dict[str, Any]:
    """Completions' ``choices[].logprobs`` for these tokens (``offset``: characters before them)."""
    tokens = [decode(token) for token in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{decode(t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }
