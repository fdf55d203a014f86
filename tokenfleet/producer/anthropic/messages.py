"""Anthropic's Messages API (``POST /v1/messages``) as a chat completion and back: its body, its
content blocks as chat messages, the message it answers with, and its stream's events. No I/O.

``system`` becomes the system message; ``text`` blocks are text, ``tool_use`` blocks an
assistant's calls and ``tool_result`` blocks ``tool`` messages; ``tools`` and ``tool_choice``
(``auto``, ``any``, ``tool``, ``none``) are chat's function tools, so calls are constrained to
valid ones and come back as ``tool_use`` blocks.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenfleet.producer.openai.format import ChatBody, Completion

STOP_REASONS = {"length": "max_tokens", "cancelled": "end_turn"}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a prefix cache hint: ours caches every prefix
    citations: list[dict[str, Any]] | None = None  # an earlier answer's, sent back: no effect


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None  # what the SDK's answer blocks carry when sent back
    toolset_name: str | None = None


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"error: {text}" if self.is_error else text


Block = TextBlock | ToolUseBlock | ToolResultBlock


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured outputs (``messages.parse``); ``effort`` has no meaning here and is refused."""

    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = None


class MessagesBody(BaseModel):
    """``POST /v1/messages``: a field it does not know is refused by name (400)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None

    def chat_body(self) -> ChatBody:
        """The chat completion that answers this body."""
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        messages = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            messages += chat_messages(message)
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,  # Anthropic's default
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences or None,
            "user": self.metadata.user_id if self.metadata else None,
        }
        if self.tools:
            chat["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in self.tools
            ]
            chat.update(self._choice())
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt.schema_},
            }
        return ChatBody(**{name: value for name, value in chat.items() if value is not None})

    def _choice(self) -> dict[str, Any]:
        choice = self.tool_choice
        if choice is None:
            return {}
        kind: Any = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
        if choice.type == "tool":
            if choice.name is None:
                raise ValueError("tool_choice of type tool needs a name")
            kind = {"type": "function", "function": {"name": choice.name}}
        parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
        return {"tool_choice": kind, "parallel_tool_calls": parallel}


def _function(tool: Tool) -> dict[str, Any]:
    return {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}


def chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results first, as ``tool`` messages."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    results = [
        {"role": "tool", "content": b.text(), "tool_call_id": b.tool_use_id}
        for b in message.content
        if isinstance(b, ToolResultBlock)
    ]
    text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
        for b in message.content
        if isinstance(b, ToolUseBlock)
    ]
    rest: list[dict[str, Any]] = []
    if text or calls or not results:
        rest = [{"role": message.role, "content": text, **({"tool_calls": calls} if calls else {})}]
    return results + rest


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def content_blocks(message_id: str, completion: Completion, text: str, finish: str) -> list[dict[str, Any]]:
    """The answer's content: ``tool_use`` blocks for calls (ids from the message's), else text
    (a call cut short included)."""
    calls = completion.calls_in(text) if finish == "stop" else None
    if calls is None:
        return [{"type": "text", "text": text}]
    return [
        {
            "type": "tool_use",
            "id": "toolu_" + hashlib.sha256(f"{message_id}/{i}".encode()).hexdigest()[:24],
            "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"]),
        }
        for i, call in enumerate(calls)
    ]


def stop_reason(blocks: list[dict[str, Any]], finish: str, stop: str | None) -> str:
    if blocks and blocks[0]["type"] == "tool_use":
        return "tool_use"
    if stop is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish, "end_turn")


def usage(counts: dict[str, int]) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are those not read from the cache."""
    cached = counts.get("cached_tokens", 0)
    return {
        "input_tokens": counts.get("prompt_tokens", 0) - cached,
        "output_tokens": counts.get("completion_tokens", 0),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def message(
    message_id: str,
    model: str,
    blocks: list[dict[str, Any]],
    finish: str,
    stop: str | None,
    counts: dict[str, int],
) -> dict[str, Any]:
    """The whole message, as ``POST /v1/messages`` answers."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop_reason(blocks, finish, stop),
        "stop_sequence": stop,
        "usage": usage(counts),
    }
