"""A message's reply events as Anthropic's stream events: ``message_start``, a text block's
``content_block_*`` events (or, for calls, each ``tool_use`` block whole at the end),
``message_delta`` with the stop reason and usage, ``message_stop``. No I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenfleet.producer.anthropic.messages import content_blocks, stop_reason, usage
from tokenfleet.producer.openai.format import Completion
from tokenfleet.protocol import DoneEvent, ReplyEvent, TokenEvent

Event = dict[str, Any]


@dataclass
class MessageFold:
    message_id: str
    model: str
    completion: Completion
    text: str = ""
    calls: bool | None = None  # None until the answer's start tells a call from text

    def opening(self) -> list[Event]:
        started: Event = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},  # the totals come in message_delta
        }
        return [{"type": "message_start", "message": started}, {"type": "ping"}]

    def fold(self, event: ReplyEvent) -> list[Event]:
        """The stream events a token or ``done`` event makes (an ``error`` is the caller's)."""
        if isinstance(event, TokenEvent):
            return self._token(event.text)
        assert isinstance(event, DoneEvent)
        return self._end(event)

    def _token(self, text: str) -> list[Event]:
        self.text += text
        if self.calls is None:
            if not self.text:
                return []
            self.calls = self.completion.answers_with_calls(self.text)
            if not self.calls:
                return [_text_start(), _text_delta(self.text)]
        return [] if self.calls or not text else [_text_delta(text)]

    def _end(self, done: DoneEvent) -> list[Event]:
        blocks = content_blocks(self.message_id, self.completion, self.text, done.finish_reason)
        events: list[Event] = []
        if blocks[0]["type"] == "tool_use":
            for index, block in enumerate(blocks):
                started = {**block, "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                events += [
                    {"type": "content_block_start", "index": index, "content_block": started},
                    {"type": "content_block_delta", "index": index, "delta": delta},
                    {"type": "content_block_stop", "index": index},
                ]
        else:
            if self.calls is not False:  # not yet opened: no text at all, or calls cut short
                events += [_text_start(), *([_text_delta(self.text)] if self.text else [])]
            events.append({"type": "content_block_stop", "index": 0})
        reason = stop_reason(blocks, done.finish_reason, done.stop)
        ending: Event = {
            "stop_reason": reason,
            "stop_sequence": done.stop,
            "stop_details": None,
            "container": None,
        }
        return [
            *events,
            {"type": "message_delta", "delta": ending, "usage": usage(done.usage)},
            {"type": "message_stop"},
        ]


def _text_start() -> Event:
    return {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}


def _text_delta(text: str) -> Event:
    return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
