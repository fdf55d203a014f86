"""OpenAI's completion and chat formats, translated to tokenfleet requests and back: one place for
the gateway, the Batch API and `tokenfleet batch`. No I/O.

A body of ``n`` choices over ``p`` prompts becomes ``p x n`` tokenfleet requests, choice ``k``
being prompt ``k // n``; their ids are the completion's id and the choice's index.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenfleet.config import GatewayConfig
from tokenfleet.producer.openai.controls import (
    ChatLogprobFields,
    CompletionLogprobFields,
    ControlFields,
    Decode,
    shaped_logprobs,
    token_id_text,
)
from tokenfleet.producer.openai.tools import ChatMessage, ToolFields, history_message, is_call, tool_calls
from tokenfleet.producer.result import Result
from tokenfleet.protocol import LANES, ErrorCode, TokenLogprob

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 16
# reply codes that are the request's fault (HTTP 400); the rest are the fleet's (500)
CLIENT_ERROR_CODES = frozenset(
    {
        ErrorCode.INVALID_REQUEST,
        ErrorCode.PROMPT_TOO_LONG,
        ErrorCode.MAX_SEQ_LEN_EXCEEDED,
        ErrorCode.CACHE_TOO_SMALL,
        ErrorCode.UNDECODABLE,
        ErrorCode.UNSUPPORTED_VERSION,
        ErrorCode.DUPLICATE_ID,
        ErrorCode.INVALID_GRAMMAR,
        ErrorCode.ADAPTER_UNAVAILABLE,  # the caller's adapter cannot load: vLLM answers 400 too
    }
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Body(ControlFields):
    """What both endpoints take. A field it does not know is refused by name (400, ``param``):
    never ignored, as an output control it cannot honour would be."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    stream: bool = False
    stream_options: StreamOptions | None = None
    service_tier: str | None = None  # OpenAI's: "flex" goes in the batch lane
    priority: int | str | None = None  # vLLM's extension (> 0: later), or a lane's name

    @field_validator("priority")
    @classmethod
    def known_lane(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, str) and value not in LANES:
            raise ValueError(f"priority must be an integer or one of {', '.join(LANES)}")
        return value

    def lane(self) -> str | None:
        """The priority lane the body asks for, if any: a lane's name, vLLM's integer priority
        (above 0 is the batch lane) or OpenAI's ``service_tier`` (``flex`` is the batch lane)."""
        if isinstance(self.priority, str):
            return self.priority
        if self.priority is not None:
            return LANES[1] if self.priority > 0 else LANES[0]
        if self.service_tier == "flex":
            return LANES[1]
        return LANES[0] if self.service_tier == "priority" else None

    def request_params(self, default_max_tokens: int) -> dict[str, Any]:
        """Sampling and length settings as tokenfleet request fields."""
        params: dict[str, Any] = {
            "max_new_tokens": self.max_completion_tokens or self.max_tokens or default_max_tokens,
            "temperature": self.temperature if self.temperature is not None else 1.0,
        }
        if self.top_p is not None:
            params["top_p"] = self.top_p
        if self.seed is not None:
            params["seed"] = self.seed
        if self.stop:
            params["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.ignore_eos:
            params["ignore_eos"] = True
        return {**params, **self.control_params(self.logprobs_asked())}

    def logprobs_asked(self) -> int | None:
        """How many alternatives per token the body asks logprobs for (None: no logprobs)."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(CompletionLogprobFields, _Body):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]

    def inputs(self) -> list[dict[str, Any]]:
        """One tokenfleet input per prompt: ``prompt`` text or ``input_ids``."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if not p:
            raise ValueError("prompt is empty")
        if all(isinstance(x, str) for x in p):
            return [{"prompt": x} for x in p]
        if all(isinstance(x, int) for x in p):
            return [{"input_ids": list(p)}]
        return [{"input_ids": list(x)} for x in p]  # type: ignore[arg-type]


class ChatBody(ChatLogprobFields, ToolFields, _Body):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)

    @model_validator(mode="after")
    def tool_calls_alone(self) -> ChatBody:
        if (self.calls_a_tool() or self.may_call_a_tool()) and self.response_format is not None:
            raise ValueError("response_format and tools cannot be asked for together")
        return self

    def inputs(self) -> list[dict[str, Any]]:
        messages = [history_message(m.role, str(m.content or ""), m.tool_calls) for m in self.messages]
        offered = self.calls_a_tool() or self.may_call_a_tool()
        return [{"messages": [self.tools_message(), *messages] if offered else messages}]

    def request_params(self, default_max_tokens: int) -> dict[str, Any]:
        params = super().request_params(default_max_tokens)
        if self.calls_a_tool():
            params["response_format"] = self.call_format()
        elif self.may_call_a_tool():
            params["response_format"] = self.auto_format()
        return params


Kind = Literal["text", "chat"]


@dataclass(frozen=True)
class Completion:
    """What identifies a completion across gateway replicas: kept in Redis beside its requests."""

    id: str
    kind: Kind
    model: str
    choices: int  # requests: prompts x n
    n: int
    created: int
    tool_call: bool = False  # chat with tool_choice required or named: the answer is a call
    tool_auto: bool = False  # chat with tool_choice auto: the answer is text or tagged calls

    @classmethod
    def of(cls, completion_id: str, kind: Kind, body: CompletionBody | ChatBody) -> Completion:
        tool_call = isinstance(body, ChatBody) and body.calls_a_tool()
        tool_auto = isinstance(body, ChatBody) and body.may_call_a_tool()
        choices = len(body.inputs()) * body.n
        return cls(completion_id, kind, body.model, choices, body.n, int(time.time()), tool_call, tool_auto)

    @classmethod
    def new(cls, kind: Kind, body: CompletionBody | ChatBody) -> Completion:
        """A completion with a fresh id (OpenAI's ``cmpl-`` / ``chatcmpl-`` form)."""
        return cls.of(("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex, kind, body)

    def submissions(
        self,
        body: CompletionBody | ChatBody,
        default_max_tokens: int | None = None,
        lane: str | None = None,
        **extra: Any,
    ) -> list[tuple[str, dict[str, Any]]]:
        """Each choice's request id and submit arguments (``extra``: e.g. a deadline); ``lane``
        is the priority lane unless the body asks for one (bulk jobs pass the batch lane)."""
        # a chat without max_tokens: the gateway's setting, else its default (OpenAI's: the context's rest)
        default = default_max_tokens or (
            GatewayConfig.default_max_tokens if self.kind == "chat" else COMPLETIONS_DEFAULT_MAX_TOKENS
        )
        inputs, params = body.inputs(), body.request_params(default)
        if body.lane() or lane:
            params["priority"] = body.lane() or lane
        out = []
        for k in range(self.choices):
            choice = {**inputs[k // self.n], **params, **extra}
            if "seed" in choice:  # the n samples of one prompt must differ
                choice["seed"] += k % self.n
            out.append((self.request_id(k), choice))
        return out

    def request_id(self, choice: int) -> str:
        return f"{self.id}.{choice}"

    @property
    def request_ids(self) -> list[str]:
        return [self.request_id(i) for i in range(self.choices)]

    def header(self) -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, results: list[Result], decode: Decode = token_id_text) -> dict[str, Any]:
        """The whole completion object, from each choice's result (``decode``: a token's text,
        for logprobs)."""
        choices = []
        for index, res in enumerate(results):
            choice: dict[str, Any] = {"index": index, "finish_reason": res.finish_reason}
            calls = self.calls_in(res.text) if res.finish_reason == "stop" else None
            if calls is not None:
                choice.update(message={"role": "assistant", "content": None, "tool_calls": calls})
                choice["finish_reason"] = "tool_calls"
            elif self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": res.text}
            else:
                choice["text"] = res.text
            choice.update(
                logprobs=shaped_logprobs(self.kind == "chat", res.logprobs, res.token_ids, decode, 0),
                token_ids=res.token_ids,
            )
            choices.append(choice)
        return {**self.header(), "choices": choices, "usage": self.usage([r.usage for r in results])}

    def calls_in(self, text: str) -> list[dict[str, Any]] | None:
        """An ended answer's tool calls, or None where it is text (or a call that did not end)."""
        return tool_calls(text) if self.answers_with_calls(text) else None

    def answers_with_calls(self, text: str) -> bool:
        """Whether an answer (or its start, while streaming) is tool calls rather than text."""
        return self.tool_call or (self.tool_auto and is_call(text))

    def usage(self, usages: list[dict[str, int]]) -> dict[str, Any]:
        """From each choice's reply ``usage``: prompt tokens once per prompt (its ``n`` choices
        share it) and of those the prefix cache held, completion tokens of all."""
        prompt = sum(u.get("prompt_tokens", 0) for u in usages[:: self.n])
        cached = sum(u.get("cached_tokens", 0) for u in usages[:: self.n])
        completion = sum(u.get("completion_tokens", 0) for u in usages)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        first: bool,
        finish: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
        decode: Decode = token_id_text,
    ) -> dict[str, Any]:
        """One streamed chunk of choice ``index`` (OpenAI's chunk format)."""
        header = self.header()
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "token_ids": token_ids}
        if self.kind == "chat":
            header["object"] = "chat.completion.chunk"
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = shaped_logprobs(self.kind == "chat", logprobs, token_ids, decode, None)
        return {**header, "choices": [choice]}

    def tool_call_chunk(self, index: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """Streamed tool calls, whole: the chunk before the closing one."""
        calls = [{"index": i, **call} for i, call in enumerate(calls)]
        delta = {"role": "assistant", "content": None, "tool_calls": calls}
        choice = {"index": index, "finish_reason": None, "delta": delta, "logprobs": None}
        return {**self.header(), "object": "chat.completion.chunk", "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        header = self.header()
        if self.kind == "chat":
            header["object"] = "chat.completion.chunk"
        return {**header, "choices": [], "usage": usage}
