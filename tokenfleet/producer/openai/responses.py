"""OpenAI's Responses API (``POST /v1/responses``) as a chat completion and back: its body, its
input items as chat messages, and the response object. No I/O.

A response is one chat request: ``instructions`` become its system message, the history of a
``previous_response_id`` and the ``input`` items its other messages, ``text.format`` its
``response_format``, the function ``tools`` and ``tool_choice`` chat's. What comes back is the
response object's ``output`` (``response_output.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenfleet.producer.openai.format import ChatBody

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
Item = dict[str, Any]


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without that training has


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class ResponseBody(BaseModel):
    """``POST /v1/responses``: a field it does not know is refused by name (400, ``param``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    model: str
    input: str | list[Item] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    background: bool = False
    stream: bool = False
    store: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop turns silently: refused
    ignore_eos: bool = False  # vLLM's extension, as on chat: generate max_output_tokens

    @field_validator("input")
    @classmethod
    def items_we_can_read(cls, value: str | list[Item]) -> str | list[Item]:
        if isinstance(value, list):
            messages(value)  # a ValueError names the item we cannot take
        return value

    @model_validator(mode="after")
    def consistent(self) -> ResponseBody:
        if self.background and not self.store:
            raise ValueError("background responses need store: true")
        fmt = self.text.format if self.text else None
        if self.tools and self.tool_choice != "none" and fmt is not None and fmt.type != "text":
            raise ValueError("text.format and tools cannot be asked for together")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` as chat's ``response_format``."""
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_ or {}}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": spec}

    def chat_body(self, history: list[Item], default_max_tokens: int) -> ChatBody:
        """The chat completion that answers this body after ``history`` (earlier turns' items)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        tools = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in self.tools or []
        ]
        choice: Any = self.tool_choice
        if isinstance(choice, NamedTool):
            choice = {"type": "function", "function": {"name": choice.name}}
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": system + messages([*history, *input_items(self.input)]),
            "max_tokens": self.max_output_tokens or default_max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": tools or None,
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.response_format(),
            "user": self.user,
            "prompt_cache_key": self.prompt_cache_key,
            "safety_identifier": self.safety_identifier,
            "service_tier": self.service_tier,
            "ignore_eos": self.ignore_eos or None,
        }
        return ChatBody(**{name: value for name, value in chat.items() if value is not None})


def input_items(value: str | list[Item]) -> list[Item]:
    """The ``input`` as items in their full form (``type``, ``id``, content as parts), as
    ``GET /v1/responses/{id}/input_items`` lists them."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    items = []
    for item in value:
        kind = item.get("type", "message")
        full = {**item, "type": kind, "id": item.get("id") or _item_id(kind)}
        if kind == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            content = item.get("content")
            if isinstance(content, str):
                full["content"] = [{"type": part, "text": content}]
            full.setdefault("status", "completed")
        items.append(full)
    return items


def messages(items: list[Item]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls are one assistant turn's calls,
    a function call's output a ``tool`` message. ``ValueError`` names what cannot be taken."""
    out: list[dict[str, Any]] = []
    for n, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"input[{n}] is not an item")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(str(item.get("role")))
            if role is None:
                raise ValueError(f"input[{n}].role must be one of {', '.join(ROLES)}")
            out.append({"role": role, "content": _text(item.get("content"), n)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": _function(item, n)}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise ValueError(f"input[{n}].output must be a string")
            out.append({"role": "tool", "content": output, "tool_call_id": item.get("call_id")})
        else:
            raise ValueError(f"input[{n}]: items of type {kind!r} are not supported")
    return out


def _text(content: Any, n: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"input[{n}].content must be a string or a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ValueError(f"input[{n}].content: parts of type {kind!r} are not supported")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _function(item: Item, n: int) -> dict[str, str]:
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise ValueError(f"input[{n}]: a function_call needs a name and arguments (a string)")
    return {"name": name, "arguments": arguments}


def _item_id(kind: str) -> str:
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "item")
    return f"{prefix}_{uuid.uuid4().hex}"


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def now() -> int:
    return int(time.time())
