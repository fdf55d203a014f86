"""``tool_choice`` auto's wire shapes, pure: the grammar it asks for, calls parsed from tagged
text, and a history's calls and results rendered for the model."""

import json

import llguidance

from tokenfleet.producer.openai.format import ChatBody, Completion
from tokenfleet.producer.openai.tools import history_message, tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}


def test_auto_is_the_default_with_tools_and_asks_for_text_or_tagged_calls():
    body = ChatBody(**ASK, tools=[WEATHER])
    assert body.may_call_a_tool() and not body.calls_a_tool()
    [inputs] = body.inputs()
    assert inputs["messages"][0]["role"] == "system" and "<tool_call>" in inputs["messages"][0]["content"]
    grammar = body.request_params(16)["response_format"]
    assert grammar["type"] == "grammar" and 'calls: call ("\\n" call)*' in grammar["grammar"]
    llguidance.LLMatcher.grammar_from_lark(grammar["grammar"])  # the worker's engine takes it
    single = ChatBody(**ASK, tools=[WEATHER], parallel_tool_calls=False).request_params(16)
    assert "calls: call\n" in single["response_format"]["grammar"]
    assert "response_format" not in ChatBody(**ASK, tools=[WEATHER], tool_choice="none").request_params(16)


def test_tagged_calls_parse_into_openai_tool_calls_and_text_stays_text():
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    calls = tool_calls(text)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    completion = Completion.new("chat", ChatBody(**ASK, tools=[WEATHER]))
    assert completion.tool_auto and completion.answers_with_calls(text)
    assert not completion.answers_with_calls("It is sunny.")
    assert tool_calls('{"name": "get_weather", "arguments": {}}')[0]["function"]["name"] == "get_weather"


def test_a_history_with_a_call_and_its_result_goes_back_in_tags():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assistant = history_message("assistant", "", [call])
    assert assistant == {
        "role": "assistant",
        "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    }
    assert history_message("tool", "18 C", None) == {
        "role": "user",
        "content": "<tool_response>\n18 C\n</tool_response>",
    }
    body = ChatBody(
        model="m",
        messages=[
            ASK["messages"][0],
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        ],
        tools=[WEATHER],
    )
    rendered = body.inputs()[0]["messages"]
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[2]["content"].startswith("<tool_call>") and "18 C" in rendered[3]["content"]
