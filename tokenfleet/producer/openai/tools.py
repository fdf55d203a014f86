"""OpenAI's function tools on chat completions. The tools are described to the model in a
system message. With ``tool_choice`` ``required`` or a named function the output is constrained
to one valid call (a JSON object ``{"name", "arguments"}`` whose arguments match the function's
parameters schema); with ``auto`` (the default with tools) to either text that does not start
with ``<`` or one or more Hermes-style calls, ``<tool_call>{...}</tool_call>`` (one only with
``parallel_tool_calls: false``), so any model's call is valid. Calls come back as
``message.tool_calls``; ``none`` offers no tools. Earlier calls and their results in the history
go back to the model in the same tags (``<tool_call>``, ``<tool_response>``). No I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenfleet.protocol.output_controls import closed_objects

TOOLS_PROMPT = (
    "You can call these functions. Reply with one call only, as a JSON object "
    '{{"name": <function name>, "arguments": <its arguments>}}.\n{tools}'
)
AUTO_PROMPT = (
    "You can call these functions. To call one, reply with "
    '<tool_call>{{"name": <function name>, "arguments": <its arguments>}}</tool_call>{more} and '
    "nothing else; otherwise answer in text.\n<tools>\n{tools}\n</tools>"
)
CALL_TAG = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = ""
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call (the order of messages carries it)

    @field_validator("content")
    @classmethod
    def text_only(cls, value: Any) -> str:
        """Content parts of type ``text`` are joined; other kinds (images, audio) are refused."""
        if value is None or isinstance(value, str):
            return value or ""
        texts = []
        for part in value:
            if part.get("type") != "text":
                raise ValueError(f"content parts of type {part.get('type')!r} are not supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ToolFields(BaseModel):
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body."""

    tools: list[ToolSpec] | None = Field(None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def a_choice_we_can_keep(self) -> ToolFields:
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise ValueError("tool_choice needs tools")
            return self
        if isinstance(choice, NamedChoice) and choice.function.name not in self._names():
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        return self

    def _names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or []]

    def calls_a_tool(self) -> bool:
        """Whether the output is a tool call (``required`` or a named function)."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    def may_call_a_tool(self) -> bool:
        """Whether the model chooses between text and calls (``auto``, the default with tools)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def tools_message(self) -> dict[str, str]:
        """The system message that describes the callable functions to the model."""
        offered = [t.function.model_dump(exclude_none=True) for t in self._callable()]
        if self.may_call_a_tool():
            more = "" if self.parallel_tool_calls is False else " (several calls: one after another)"
            tools = "\n".join(json.dumps(spec) for spec in offered)
            return {"role": "system", "content": AUTO_PROMPT.format(tools=tools, more=more)}
        return {"role": "system", "content": TOOLS_PROMPT.format(tools=json.dumps(offered))}

    def auto_format(self) -> dict[str, Any]:
        """The ``response_format`` of ``auto``: text not starting with ``<``, or tagged calls."""
        # compact JSON (a small model free to add whitespace spends its tokens on nothing else)
        closed = closed_objects(self.call_format()["json_schema"]["schema"])  # as json_schema's are
        schema = {**closed, "x-guidance": {"whitespace_flexible": False}}
        call = json.dumps(schema)
        calls = "call" if self.parallel_tool_calls is False else 'call ("\\n" call)*'
        lark = (
            f"start: calls | text\ncalls: {calls}\n"
            f'call: "<tool_call>" %json {call} "</tool_call>"\ntext: /[^<][\\s\\S]*/\n'
        )
        return {"type": "grammar", "grammar": lark}

    def call_format(self) -> dict[str, Any]:
        """The ``response_format`` that makes the output one valid call of a callable function."""
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    "arguments": tool.function.parameters or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in self._callable()
        ]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}

    def _callable(self) -> list[ToolSpec]:
        choice = self.tool_choice
        if isinstance(choice, NamedChoice):
            return [t for t in self.tools or [] if t.function.name == choice.function.name]
        return list(self.tools or [])


def tool_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI's ``message.tool_calls`` from a constrained answer: one call's JSON (``required``, a
    named function) or, under ``auto``, ``<tool_call>``-tagged calls; None where the text holds
    no whole call (cut short, or a stop string took its end): it is then text."""
    found = CALL_TAG.findall(text) if text.startswith("<tool_call>") else [text]
    try:
        calls = [json.loads(call) for call in found]
    except ValueError:
        return None
    whole = all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)
        for c in calls
    )
    return [_openai_call(call) for call in calls] if calls and whole else None


def is_call(text: str) -> bool:
    """Whether an ``auto`` answer (its start is enough) is calls rather than text."""
    return text.startswith("<")


def _openai_call(call: dict[str, Any]) -> dict[str, Any]:
    function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": function}


def history_message(role: str, content: str, calls: list[dict[str, Any]] | None) -> dict[str, str]:
    """A chat message as the model sees it: an assistant's earlier calls in ``<tool_call>`` tags
    after its text, a ``tool`` result as a user turn in ``<tool_response>`` tags (any template
    renders those; Hermes and Qwen templates render tool results the same way)."""
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if role == "assistant" and calls:
        tagged = "".join(
            "<tool_call>"
            + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"])})
            + "</tool_call>"
            for c in calls
        )
        return {"role": role, "content": content + tagged}
    return {"role": role, "content": content}


def _arguments(function: dict[str, Any]) -> Any:
    arguments = function.get("arguments") or "{}"
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments
