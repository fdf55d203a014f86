"""OpenAI's function tools on chat completions: with ``tool_choice`` ``required`` or a named
function, the tools are described to the model in a system message and its output is
constrained to a valid call (a JSON object ``{"name", "arguments"}`` whose arguments match the
function's parameters schema), returned as ``message.tool_calls``. ``none`` offers no tools.
``auto`` (letting the model choose between text and a call) is refused by name: it needs a
per-model call format this gateway does not parse yet. No I/O.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TOOLS_PROMPT = (
    "You can call these functions. Reply with one call only, as a JSON object "
    '{{"name": <function name>, "arguments": <its arguments>}}.\n{tools}'
)


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
        if choice in (None, "auto"):
            raise ValueError(
                "tool_choice auto (the default with tools) is not supported: send tool_choice "
                "required, a named function, or none"
            )
        if isinstance(choice, NamedChoice) and choice.function.name not in self._names():
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        return self

    def _names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or []]

    def calls_a_tool(self) -> bool:
        """Whether the output is a tool call (``required`` or a named function)."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    def tools_message(self) -> dict[str, str]:
        """The system message that describes the callable functions to the model."""
        offered = [t.function.model_dump(exclude_none=True) for t in self._callable()]
        return {"role": "system", "content": TOOLS_PROMPT.format(tools=json.dumps(offered))}

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


def tool_calls(text: str) -> list[dict[str, Any]]:
    """OpenAI's ``message.tool_calls`` from a constrained call's text (one call)."""
    call = json.loads(text)
    function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": function}]
