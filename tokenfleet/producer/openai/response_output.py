"""What a response returns: its ``output`` (a ``message`` item, or ``function_call`` items), the
response object, and its reply events as the Responses API's stream events, numbered. No I/O.

The events are a function of the reply stream alone (ids included), so any gateway replica that
folds the same reply stream again numbers every event the same: a client resumes a background
stream with ``starting_after`` anywhere.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.producer.openai.format import Completion
from tokenfleet.producer.openai.responses import Item
from tokenfleet.protocol import DoneEvent, ErrorEvent, ReplyEvent, TokenEvent

Event = dict[str, Any]
ENDINGS = {"stop": "completed", "length": "incomplete", "cancelled": "cancelled"}
TERMINAL = frozenset({"completed", "incomplete", "cancelled", "failed"})
CLOSING_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.failed",  # the API has no event of its own: the status says cancelled
}


@dataclass
class ResponseFold:
    """Where a response stands after the reply events folded into it so far."""

    response_id: str
    body: dict[str, Any]  # the create body as stored
    created_at: int
    completion: Completion
    text: str = ""
    calls: bool | None = None  # None until the answer's start tells a call from text
    status: str = "in_progress"
    output: list[Item] = field(default_factory=list)
    usage: dict[str, int] | None = None
    error: dict[str, str] | None = None
    sequence: int = 0

    def snapshot(self, cancelled: bool = False) -> dict[str, Any]:
        """The response object now (``cancelled``: a cancel was asked and nothing ended it yet)."""
        status = "cancelled" if cancelled and self.status not in TERMINAL else self.status
        output = self.output
        if status not in TERMINAL and self.calls is False:
            output = [message_item(self.response_id, self.text, "in_progress")]
        return response_object(
            self.response_id, self.body, self.created_at, status, output, self.usage, self.error
        )

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL

    def opening(self) -> list[Event]:
        """The events every stream starts with."""
        first = "queued" if self.body.get("background") else "in_progress"
        created = {**self.snapshot(), "status": first}
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=self.snapshot()),
        ]

    def fold(self, event: ReplyEvent) -> list[Event]:
        """The stream events ``event`` makes, the response advanced past it."""
        if isinstance(event, TokenEvent):
            return self._token(event.text)
        if isinstance(event, DoneEvent):
            self.usage = event.usage
            return self._end(event.finish_reason)
        return self._failed(event)

    def _token(self, text: str) -> list[Event]:
        self.text += text
        if self.calls is None:
            if not self.text:  # nothing yet tells a call from text
                return []
            self.calls = self.completion.answers_with_calls(self.text)
            if not self.calls:
                return [*self._message_opened(), self._delta(self.text)]
        if self.calls or not text:
            return []  # calls go out whole at their end
        return [self._delta(text)]

    def _message_opened(self) -> list[Event]:
        item = message_item(self.response_id, "", "in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._where(), part=part),
        ]

    def _delta(self, text: str) -> Event:
        return self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])

    def _where(self) -> dict[str, Any]:
        item_id = "msg_" + self.response_id.removeprefix("resp_")
        return {"item_id": item_id, "output_index": 0, "content_index": 0}

    def _end(self, finish: str) -> list[Event]:
        self.output = output_items(self.response_id, self.completion, self.text, finish)
        events = []
        if self.output and self.output[0]["type"] == "function_call":
            for index, item in enumerate(self.output):
                events += self._call_events(index, item)
        else:
            if self.calls is not False:  # the message was never opened: calls cut short, or no text
                events += self._message_opened()
                if self.text:
                    events.append(self._delta(self.text))
            item = self.output[0] if self.output else message_item(self.response_id, "", "completed")
            self.output = [item]
            part = item["content"][0]
            events += [
                self._event("response.output_text.done", **self._where(), text=self.text, logprobs=[]),
                self._event("response.content_part.done", **self._where(), part=part),
                self._event("response.output_item.done", output_index=0, item=item),
            ]
        self.status = ENDINGS.get(finish, "completed")
        return [*events, self._event(CLOSING_EVENT[self.status], response=self.snapshot())]

    def _call_events(self, index: int, item: Item) -> list[Event]:
        opened = {**item, "arguments": "", "status": "in_progress"}
        where = {"item_id": item["id"], "output_index": index}
        return [
            self._event("response.output_item.added", output_index=index, item=opened),
            self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self._event("response.function_call_arguments.done", **where, **_named(item)),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _failed(self, event: ErrorEvent) -> list[Event]:
        self.status, self.error = "failed", {"code": event.code, "message": event.message}
        if self.calls is False:
            self.output = [message_item(self.response_id, self.text, "incomplete")]
        return [self._event(CLOSING_EVENT[self.status], response=self.snapshot())]

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event


def _named(item: Item) -> dict[str, str]:
    return {"name": item["name"], "arguments": item["arguments"]}


def output_items(response_id: str, completion: Completion, text: str, finish: str | None) -> list[Item]:
    """The ``output`` of an answer so far (``finish``: its finish reason once it has ended).
    Ids are the response's, so every replica that builds it again builds the same."""
    calls = completion.calls_in(text) if finish == "stop" else None
    if calls is not None:
        return [
            function_call_item(response_id, i, call["function"]["name"], call["function"]["arguments"])
            for i, call in enumerate(calls)
        ]
    if not text and finish is None:
        return []
    return [message_item(response_id, text, "completed" if finish else "in_progress")]


def message_item(response_id: str, text: str, status: str) -> Item:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": "msg_" + _suffix(response_id),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(response_id: str, index: int, name: str, arguments: str) -> Item:
    digest = hashlib.sha256(f"{response_id}/{index}".encode()).hexdigest()
    return {
        "type": "function_call",
        "id": f"fc_{_suffix(response_id)}_{index}",
        "call_id": "call_" + digest[:24],
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _suffix(response_id: str) -> str:
    return response_id.removeprefix("resp_")


def response_object(
    response_id: str,
    body: dict[str, Any],
    created_at: int,
    status: str,
    output: list[Item],
    usage: dict[str, int] | None = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The response object (OpenAI's shape) of a body (as stored) at ``status``."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": body.get("background", False),
        "error": error,
        "incomplete_details": incomplete,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body["model"],
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "service_tier": body.get("service_tier") or "default",
        "store": body.get("store", True),
        "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
        "text": {"format": fmt},
        "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
        "truncation": "disabled",
        "usage": None if usage is None else response_usage(usage),
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def response_usage(usage: dict[str, int]) -> dict[str, Any]:
    prompt, generated = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }
