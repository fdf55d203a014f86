"""Anthropic's Messages API's pure parts: content blocks as chat messages, what is refused, and
a stream's events (no Redis, no model)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokenfleet.producer.anthropic.messages import MessagesBody
from tokenfleet.producer.anthropic.stream import MessageFold
from tokenfleet.producer.openai.format import Completion
from tokenfleet.protocol import DoneEvent, TokenEvent

TOOL = {"name": "lookup", "input_schema": {"type": "object", "properties": {}}}


def test_blocks_become_chat_messages_tool_results_first():
    body = MessagesBody(
        model="m",
        max_tokens=5,
        system=[{"type": "text", "text": "be terse"}],
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": 1}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and?"},
                    {"type": "tool_result", "tool_use_id": "t1", "content": "found", "is_error": True},
                ],
            },
        ],
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
    )
    chat = body.chat_body()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[3].content == "error: found" and chat.messages[2].tool_calls[0]["id"] == "t1"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False and chat.stop == ["END"]


@pytest.mark.parametrize(
    "extra",
    [
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"output_config": {"effort": "high"}},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"temperature": 1.5},
    ],
)
def test_what_cannot_be_honoured_is_refused(extra):
    with pytest.raises(ValidationError):
        MessagesBody(
            **{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
        )


def test_a_stream_opens_streams_text_and_ends_with_the_stop_that_matched():
    body = MessagesBody(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    fold = MessageFold("msg_1", "m", Completion.of("msg_1", "chat", body.chat_body()))
    done = DoneEvent("stop", 7, 2, cached_tokens=3, stop="!")
    events = [*fold.opening(), *fold.fold(TokenEvent(0, [1], "Hi")), *fold.fold(done)]
    kinds = [e["type"] for e in events]
    assert kinds == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert (
        events[-2]["delta"]["stop_reason"] == "stop_sequence" and events[-2]["delta"]["stop_sequence"] == "!"
    )
    assert events[-2]["usage"] == {
        "input_tokens": 4, "output_tokens": 2, "cache_read_input_tokens": 3, "cache_creation_input_tokens": 0,
    }  # fmt: skip


def test_a_call_that_never_closed_is_a_text_block():
    body = MessagesBody(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}], tools=[TOOL])
    fold = MessageFold("msg_2", "m", Completion.of("msg_2", "chat", body.chat_body()))
    cut = '<tool_call>{"name": "lookup"'
    events = [*fold.opening(), *fold.fold(TokenEvent(0, [1], cut)), *fold.fold(DoneEvent("stop", 5, 1))]
    deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == [cut] and events[-2]["delta"]["stop_reason"] == "end_turn"
