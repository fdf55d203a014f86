"""The Responses API's pure parts: a body's input items as chat messages, and reply events folded
into stream events that any replica numbers the same (no Redis, no model)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tokenfleet.producer.openai.format import Completion
from tokenfleet.producer.openai.response_output import ResponseFold
from tokenfleet.producer.openai.responses import ResponseBody
from tokenfleet.protocol import DoneEvent, ErrorEvent, TokenEvent

TOOL = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}


def fold_of(body: ResponseBody, response_id: str = "resp_abc") -> ResponseFold:
    chat = body.chat_body([], 16)
    kept = body.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"input"})
    return ResponseFold(response_id, kept, 0, Completion.of(response_id, "chat", chat))


def run(fold: ResponseFold, events) -> list[dict]:
    out = fold.opening()
    for event in events:
        out += fold.fold(event)
    return out


def test_input_items_become_chat_messages_with_calls_and_their_outputs():
    body = ResponseBody(
        model="m",
        instructions="be terse",
        input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
        ],
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        max_output_tokens=9,
    )
    chat = body.chat_body([{"role": "user", "content": "earlier"}], 16)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "system", "user", "assistant", "tool"]
    assert [c["id"] for c in chat.messages[4].tool_calls] == ["c1", "c2"]
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }
    assert chat.max_tokens == 9


@pytest.mark.parametrize(
    "extra",
    [
        {"reasoning": {"effort": "low"}},
        {"truncation": "auto"},
        {"input": [{"type": "item_reference", "id": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        {"background": True, "store": False},
        {"tools": [TOOL], "text": {"format": {"type": "json_object"}}},
    ],
)
def test_what_cannot_be_honoured_is_refused(extra):
    with pytest.raises(ValidationError):
        ResponseBody(**{"model": "m", "input": "hi", **extra})


def test_a_text_answer_folds_into_numbered_events_the_same_every_time():
    body = ResponseBody(model="m", input="hi", background=True)
    replies = [
        TokenEvent(0, [1], ""),
        TokenEvent(1, [2], "Hel"),
        TokenEvent(2, [3], "lo"),
        DoneEvent("length", 3, 3),
    ]
    first, again = run(fold_of(body), replies), run(fold_of(body), replies)
    assert first == again
    assert [e["sequence_number"] for e in first] == list(range(len(first)))
    kinds = [e["type"] for e in first]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.incomplete" and first[0]["response"]["status"] == "queued"
    final = first[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["usage"]["output_tokens"] == 3


def test_a_call_under_auto_goes_out_whole_with_stable_ids():
    body = ResponseBody(model="m", input="hi", tools=[TOOL])
    call = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    replies = [TokenEvent(0, [1], call[:5]), TokenEvent(1, [2], call[5:]), DoneEvent("stop", 3, 2)]
    events = run(fold_of(body), replies)
    assert "response.output_text.delta" not in [e["type"] for e in events]
    item = events[-1]["response"]["output"][0]
    assert (
        item["type"] == "function_call" and item["name"] == "lookup" and json.loads(item["arguments"]) == {}
    )
    assert item["call_id"] == run(fold_of(body), replies)[-1]["response"]["output"][0]["call_id"]


def test_an_error_fails_the_response_and_keeps_its_text():
    fold = fold_of(ResponseBody(model="m", input="hi"))
    events = run(fold, [TokenEvent(0, [1], "par"), ErrorEvent("internal_error", "boom")])
    response = events[-1]["response"]
    assert events[-1]["type"] == "response.failed" and response["error"]["code"] == "internal_error"
    assert response["output"][0]["content"][0]["text"] == "par" and fold.ended


def test_a_call_cut_short_by_a_stop_string_is_text():
    body = ResponseBody(model="m", input="hi", tools=[TOOL])
    cut = '<tool_call>{"name": "lookup", "arguments": {}}'  # "</tool_call>" was a stop string
    events = run(fold_of(body), [TokenEvent(0, [1], cut), DoneEvent("stop", 3, 1)])
    item = events[-1]["response"]["output"][0]
    assert item["type"] == "message" and item["content"][0]["text"] == cut
    assert [e["type"] for e in events].count("response.output_text.delta") == 1
