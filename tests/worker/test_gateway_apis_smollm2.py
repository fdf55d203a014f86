"""OpenAI's Responses API and Anthropic's Messages API on a real model (SmolLM2) through
`tokenfleet serve`, driven by the SDKs unchanged. openai-python: ``responses.parse`` with a
pydantic model under ``text_format``, ``responses.stream`` to its final response, function tools
(a call as a ``function_call`` item, its output sent back on the next turn by
``previous_response_id``), answers equal to the chat completion of the same conversation.
Anthropic's SDK: ``messages.create`` equal to the chat completion, ``messages.stream`` to its
final message, ``stop_sequences``, tools (a ``tool_use`` block valid against its schema, its
``tool_result`` answered on the next turn), ``messages.parse``, ``x-api-key`` taken as an API key,
and errors in Anthropic's shape."""

import json

import anthropic
import openai
import pytest
from conftest import RunningWorker, make_runner
from structured_cases import SHORT

from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig

pytestmark = pytest.mark.integration

BATCHING = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=512, buckets=(64, 128, 256))
SCHEMA = {
    "type": "object",
    "properties": {"city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
DESCRIPTION = "The weather in a city."
WEATHER = {"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": DESCRIPTION, "input_schema": SCHEMA}
KEY = "sk-test-messages"
GREEDY = {"temperature": 0}  # the Anthropic SDK no longer sends sampling fields; older ones and curl do


@pytest.fixture(scope="module")
def runner(smollm2):
    return make_runner(smollm2, device="cpu", dtype="float32", kv=KVCacheConfig(num_blocks=1024))


def test_parse_stream_and_function_calls_through_the_responses_api(runner, smollm2, redis_url, prefix):
    from gateway_process import Gateway
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    question = "What is the weather in Paris?"
    with RunningWorker(runner, redis_url, prefix, BATCHING, served_model_name="smollm2"):
        gateway = Gateway(redis_url, prefix, smollm2)
        try:
            client = gateway.openai()
            parsed = client.responses.parse(
                model="smollm2", input="Name a city in France.", text_format=City, temperature=0
            )
            with client.responses.stream(
                model="smollm2", input="Say hello.", max_output_tokens=40, temperature=0
            ) as stream:
                deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
                final = stream.get_final_response()
            chat_hello = client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=40,
                temperature=0,
            )
            called = client.responses.create(
                model="smollm2", input=question, tools=[WEATHER], tool_choice="required", temperature=0
            )
            call = called.output[0]
            answered = client.responses.create(
                model="smollm2",
                previous_response_id=called.id,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}],
                tools=[WEATHER],
                tool_choice="none",
                temperature=0,
                max_output_tokens=24,
            )
            tool_call = {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            chat_answer = client.chat.completions.create(
                model="smollm2",
                messages=[
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"},
                ],
                tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
                tool_choice="none",
                temperature=0,
                max_tokens=24,
            )
        finally:
            gateway.stop()
    city = parsed.output_parsed
    assert isinstance(city, City) and city.name and city.country
    assert (
        final.status == "completed" and deltas == final.output_text == chat_hello.choices[0].message.content
    )
    assert called.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert answered.output_text == chat_answer.choices[0].message.content


def test_the_anthropic_sdk_talks_to_the_fleet_unchanged(runner, smollm2, redis_url, prefix):
    from gateway_process import Gateway
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    hello = [{"role": "user", "content": "Say hello."}]
    with RunningWorker(runner, redis_url, prefix, BATCHING, served_model_name="smollm2"):
        gateway = Gateway(redis_url, prefix, smollm2, "--api-keys", KEY)
        client = anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0)
        chat = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
        try:
            whole = client.messages.create(
                model="smollm2", max_tokens=40, messages=hello, system="Be brief.", extra_body=GREEDY
            )
            expected = chat.chat.completions.create(
                model="smollm2",
                messages=[{"role": "system", "content": "Be brief."}, *hello],
                max_tokens=40,
                temperature=0,
            )
            with client.messages.stream(
                model="smollm2", max_tokens=40, messages=hello, extra_body=GREEDY
            ) as stream:
                streamed = "".join(stream.text_stream)
                final = stream.get_final_message()
            cut = client.messages.create(
                model="smollm2", max_tokens=40, messages=hello, extra_body=GREEDY, stop_sequences=["!", "."]
            )
            ask_tool = dict(
                model="smollm2",
                max_tokens=64,
                messages=question,
                tools=[ANTHROPIC_WEATHER],
                tool_choice={"type": "any"},
                extra_body=GREEDY,
            )
            called = client.messages.create(**ask_tool)
            use = called.content[0]
            with client.messages.stream(**ask_tool) as stream:
                streamed_call = stream.get_final_message()
            turn = [
                *question,
                {"role": "assistant", "content": called.content},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}],
                },
            ]
            answered = client.messages.create(
                model="smollm2", max_tokens=24, messages=turn, tools=[ANTHROPIC_WEATHER], extra_body=GREEDY
            )
            france = [{"role": "user", "content": "Name a city in France."}]
            parsed = client.messages.parse(
                model="smollm2", max_tokens=64, messages=france, output_format=City, extra_body=GREEDY
            )
            with pytest.raises(anthropic.BadRequestError) as refused:
                client.messages.create(
                    model="smollm2",
                    max_tokens=8,
                    messages=hello,
                    thinking={"type": "enabled", "budget_tokens": 1024},
                )
            with (
                pytest.raises(anthropic.AuthenticationError),
                anthropic.Anthropic(base_url=gateway.url, api_key="wrong", max_retries=0) as stranger,
            ):
                stranger.messages.create(model="smollm2", max_tokens=8, messages=hello)
        finally:
            client.close()
            chat.close()
            gateway.stop()
    assert whole.content[0].text == expected.choices[0].message.content
    assert whole.usage.output_tokens == expected.usage.completion_tokens and whole.stop_reason in (
        "end_turn",
        "max_tokens",
    )
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == expected.usage.prompt_tokens
    assert (
        streamed == final.content[0].text
        and final.stop_reason == "end_turn"
        and final.usage.output_tokens > 0
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence in ("!", ".")
    assert called.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert set(use.input) == {"city", "unit"} and use.input["unit"] in ("celsius", "fahrenheit")
    assert streamed_call.content[0].input == use.input and streamed_call.stop_reason == "tool_use"
    assert answered.content[0].type == "text" and answered.content[0].text
    assert (
        refused.value.body["error"]["type"] == "invalid_request_error" and "thinking" in refused.value.message
    )
    assert isinstance(parsed.parsed_output, City) and parsed.parsed_output.name
