"""The Responses API on a real model (SmolLM2) through `tokenfleet serve`, driven by openai-python
unchanged: ``responses.parse`` with a pydantic model under ``text_format``, ``responses.stream``
to its final response, and function tools: a call as a ``function_call`` item, its output sent
back as a ``function_call_output`` item on the next turn (``previous_response_id``), and the
answer equal to the chat completion of the same conversation."""

import json

import pytest
from conftest import RunningWorker, make_runner
from structured_cases import SHORT

from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig

pytestmark = pytest.mark.integration

BATCHING = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=512, buckets=(64, 128, 256))
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}


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
