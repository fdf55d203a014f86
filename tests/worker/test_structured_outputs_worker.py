"""Structured outputs on a real model (SmolLM2) through a real worker and Redis: JSON under ten
schemas, regexes and a Lark grammar always validate, batched with unconstrained requests that
still equal ``model.generate``; a grammar that cannot compile is refused with its own code,
costing its batch-mates nothing; a constrained request resumed after a kill -9 still validates;
through `tokenfleet serve`, OpenAI's ``parse``, chat logprobs, LangChain's structured output and
tool calls."""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from conftest import RunningWorker, make_runner
from structured_cases import QUESTIONS, SCHEMAS, SHORT, chat_ids

from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import ErrorCode

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runner(smollm2):

    return make_runner(smollm2, device="cpu", dtype="float32", kv=KVCacheConfig(num_blocks=1024))


def test_json_under_ten_schemas_validates_and_batch_mates_equal_generate(runner, smollm2, redis_url, prefix):
    from conftest import Reference

    reference = Reference(smollm2)
    batching = DynamicBatchingConfig(max_wait_ms=50, max_batch_size=32, max_seq_len=512, buckets=(64, 128))
    plain_questions = ["What is the capital of France?", "Name a primary color.", "Say hi.", "Count to five."]
    with (
        RunningWorker(runner, redis_url, prefix, batching) as worker,
        Client(redis_url, prefix=prefix) as client,
    ):
        submitted = []  # (schema, handle), or (the prompt's ids, handle) for an unconstrained one
        for n in range(200):  # ten schemas x twenty: half greedy, half sampled with seeds
            schema, question = SCHEMAS[n % 10], QUESTIONS[n % 10]
            sampling = {"temperature": 0.9, "seed": n} if n % 2 else {}
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{n % 10}", "schema": schema}}
            ids = chat_ids(runner.tokenizer, question if n < 20 else f"{question} (case {n})")
            submitted.append(
                (schema, client.submit(input_ids=ids, max_new_tokens=160, response_format=fmt, **sampling))
            )
            if n % 50 == 0:  # unconstrained batch-mates among them
                for q in plain_questions:
                    ids = chat_ids(runner.tokenizer, q)
                    plain = client.submit(input_ids=ids, max_new_tokens=24)
                    submitted.append((ids, plain))
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda item: (item[0], item[1].result(timeout=900)), submitted))
        worker.assert_healthy()
    checked = plain_checked = 0
    for schema, got in results:
        if isinstance(schema, list):  # unconstrained: exactly model.generate's tokens
            assert got.token_ids == reference.greedy(schema, 24)
            plain_checked += 1
            continue
        assert got.finish_reason == "stop", got.text
        jsonschema.validate(json.loads(got.text), schema)
        checked += 1
    assert checked == 200 and plain_checked == 16


def test_regex_and_lark_grammar_outputs_match(runner, redis_url, prefix):
    batching = DynamicBatchingConfig(max_wait_ms=20, max_batch_size=8, max_seq_len=512, buckets=(64, 128))
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    with RunningWorker(runner, redis_url, prefix, batching), Client(redis_url, prefix=prefix) as client:
        ids = chat_ids(runner.tokenizer, "Give a date.")
        date = client.submit(
            input_ids=ids,
            max_new_tokens=20,
            response_format={"type": "regex", "regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
        )
        answer = client.submit(
            input_ids=ids, max_new_tokens=20, response_format={"type": "grammar", "grammar": lark}
        )
        date_text, answer_text = date.result(timeout=120).text, answer.result(timeout=120).text
    import re

    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", date_text), date_text
    assert answer_text in ("The answer is yes.", "The answer is no."), answer_text


def test_a_grammar_that_cannot_compile_is_refused_alone(runner, redis_url, prefix):
    batching = DynamicBatchingConfig(max_wait_ms=50, max_batch_size=8, max_seq_len=512, buckets=(64, 128))
    with (
        RunningWorker(runner, redis_url, prefix, batching) as worker,
        Client(redis_url, prefix=prefix) as client,
    ):
        ids = chat_ids(runner.tokenizer, "Say hi.")
        bad_regex = client.submit(input_ids=ids, response_format={"type": "regex", "regex": "(unclosed"})
        bad_lark = client.submit(
            input_ids=ids, response_format={"type": "grammar", "grammar": "start: undefined_rule"}
        )
        bad_schema = client.submit(
            input_ids=ids,
            response_format={
                "type": "json_schema",
                "json_schema": {"schema": {"type": "string", "pattern": "(("}},
            },
        )
        good = client.submit(input_ids=ids, max_new_tokens=8)
        for handle in (bad_regex, bad_lark, bad_schema):
            with pytest.raises(RequestFailed) as failed:
                handle.result(timeout=60)
            assert failed.value.code == ErrorCode.INVALID_GRAMMAR, failed.value
        assert good.result(timeout=60).usage["completion_tokens"] >= 1
        worker.assert_healthy()


LONG_JSON = {
    "type": "object",
    "properties": {"steps": {"type": "array", "items": SHORT, "minItems": 12, "maxItems": 12}},
    "required": ["steps"],
    "additionalProperties": False,
}


def test_a_constrained_request_resumed_after_kill_9_still_validates(runner, smollm2, redis_url, prefix, r):
    """The worker streaming three constrained requests is killed -9; another takes them over, feeds
    the streamed tokens back into each one's grammar and goes on: every output validates, its
    reply stream has no gap and no repeat."""
    import signal
    import subprocess
    import time

    from conftest import worker_process

    from tokenfleet import protocol
    from tokenfleet.protocol import Keys

    keys = Keys(prefix)

    def events(request_id):
        return [protocol.decode_event(f) for _, f in r.xrange(keys.reply_stream(request_id))]

    first = worker_process(
        smollm2,
        redis_url,
        prefix,
        "--buckets",
        "64,128",
        "--max-wait-ms",
        "50",
        "--claim-idle-ms",
        "1000",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    fmt = {"type": "json_schema", "json_schema": {"schema": LONG_JSON}}
    try:
        with Client(redis_url, prefix=prefix, buckets=[64, 128]) as client:
            handles = [
                client.submit(
                    input_ids=chat_ids(runner.tokenizer, f"List twelve steps to {task}."),
                    max_new_tokens=400,
                    response_format=fmt,
                    **({"temperature": 0.8, "seed": 7} if task == "paint a wall" else {}),
                )
                for task in ("bake bread", "paint a wall", "plant a tree")
            ]
            deadline = time.monotonic() + 180
            while not all(r.xlen(keys.reply_stream(h.id)) >= 5 for h in handles):
                assert time.monotonic() < deadline, "the first worker never streamed"
                time.sleep(0.01)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            assert not any(events(h.id)[-1].terminal for h in handles), "one ended before the kill"
            batching = DynamicBatchingConfig(
                max_wait_ms=20, max_batch_size=8, max_seq_len=512, buckets=(64, 128)
            )
            with RunningWorker(runner, redis_url, prefix, batching, claim_idle_ms=1000) as second:
                results = [h.result(timeout=300) for h in handles]
                assert second.worker.reclaimed == len(handles)
    finally:
        if first.poll() is None:
            first.kill()
    for handle, result in zip(handles, results):
        jsonschema.validate(json.loads(result.text), LONG_JSON)
        tokens = [e for e in events(handle.id) if e.type == "token"]
        assert [e.index for e in tokens] == [sum(len(t.ids) for t in tokens[:i]) for i in range(len(tokens))]
        assert [t for e in tokens for t in e.ids] == result.token_ids  # no gap, no repeat
        assert [e.type for e in events(handle.id) if e.type != "token"] == ["done"]


def test_openai_parse_and_chat_logprobs_through_the_gateway(runner, smollm2, redis_url, prefix):
    """openai-python's ``chat.completions.parse`` with a pydantic model gets a parsed object; chat
    logprobs come in OpenAI's shape, whole and streamed, equal to each other."""
    from gateway_process import Gateway
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    batching = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=512, buckets=(64, 128))
    messages = [{"role": "user", "content": "Name a city in France."}]
    with RunningWorker(runner, redis_url, prefix, batching, served_model_name="smollm2"):
        gateway = Gateway(redis_url, prefix, smollm2)
        try:
            client = gateway.openai()
            # greedy: sampled at OpenAI's default temperature, a 135M model may ramble inside a string
            parsed = client.chat.completions.parse(
                model="smollm2", messages=messages, response_format=City, temperature=0
            )
            asked = dict(
                model="smollm2",
                messages=messages,
                max_tokens=12,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
            )
            whole = client.chat.completions.create(**asked)
            streamed = list(client.chat.completions.create(**asked, stream=True))
        finally:
            gateway.stop()
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert "".join(c.token for c in content) == whole.choices[0].message.content + "<|im_end|>" * (
        whole.choices[0].finish_reason == "stop"
    )
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-9 for c in content)
    chunked = [
        c for k in streamed if k.choices and k.choices[0].logprobs for c in k.choices[0].logprobs.content
    ]
    assert [c.token for c in chunked] == [c.token for c in content]
    assert [c.logprob for c in chunked] == pytest.approx([c.logprob for c in content])


def test_langchain_structured_output_through_the_gateway(runner, smollm2, redis_url, prefix):
    """LangChain's ``with_structured_output`` (its default: OpenAI's json_schema) gets a valid
    pydantic object from SmolLM2 through `tokenfleet serve`."""
    from gateway_process import Gateway
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Answer(BaseModel):
        city: str
        confident: bool

    batching = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=512, buckets=(64, 128))
    with RunningWorker(runner, redis_url, prefix, batching, served_model_name="smollm2"):
        gateway = Gateway(redis_url, prefix, smollm2)
        try:
            llm = ChatOpenAI(model="smollm2", base_url=gateway.url + "/v1", api_key="unused", temperature=0)
            answer = llm.with_structured_output(Answer).invoke("What is the capital of France?")
        finally:
            gateway.stop()
    assert isinstance(answer, Answer) and answer.city


def test_tool_calls_through_the_gateway(runner, smollm2, redis_url, prefix):
    """``tool_choice`` a named function or ``required``: the answer is a valid call of one of the
    tools (openai-python's ``tool_calls``, LangChain's ``bind_tools``); ``auto`` (the default):
    text, or ``<tool_call>``-tagged calls parsed into ``tool_calls`` (here the model is nudged
    toward a call with ``logit_bias`` on ``<``), whole and streamed; a history holding an earlier
    call and its result goes back to the model."""
    import openai
    from gateway_process import Gateway
    from langchain_openai import ChatOpenAI

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
    }
    clock = {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    }
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    batching = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=512, buckets=(64, 128, 256))
    with RunningWorker(runner, redis_url, prefix, batching, served_model_name="smollm2"):
        gateway = Gateway(redis_url, prefix, smollm2)
        try:
            client = gateway.openai()
            named = client.chat.completions.create(
                model="smollm2",
                messages=messages,
                tools=[weather, clock],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
            required = client.chat.completions.create(
                model="smollm2",
                messages=messages,
                tools=[weather, clock],
                tool_choice="required",
                temperature=0,
            )
            streamed = list(
                client.chat.completions.create(
                    model="smollm2",
                    messages=messages,
                    tools=[weather, clock],
                    tool_choice="required",
                    stream=True,
                    temperature=0,  # greedy: the same call as the whole one
                )
            )
            llm_required = ChatOpenAI(
                model="smollm2", base_url=gateway.url + "/v1", api_key="unused", temperature=0
            )
            bound_required = llm_required.bind_tools([weather], tool_choice="required").invoke(
                "Weather in Oslo?"
            )
            from tokenizers import Tokenizer

            lt = Tokenizer.from_file(f"{smollm2}/tokenizer.json").token_to_id("<")
            # "<" favoured everywhere: enums keep it out of the arguments, one call ends the answer
            city = {**weather["function"]["parameters"]["properties"], "city": {"enum": ["Paris", "Oslo"]}}
            listed = {
                "type": "function",
                "function": {
                    **weather["function"],
                    "parameters": {**weather["function"]["parameters"], "properties": city},
                },
            }
            nudged = {"model": "smollm2", "messages": messages, "tools": [listed], "temperature": 0}
            nudged.update(logit_bias={str(lt): 30}, parallel_tool_calls=False)
            auto_call = client.chat.completions.create(**nudged)
            auto_streamed = list(client.chat.completions.create(**nudged, stream=True))
            auto_text = client.chat.completions.create(
                model="smollm2", messages=messages, tools=[weather], temperature=0, logit_bias={str(lt): -100}
            )
            history = [
                *messages,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [auto_call.choices[0].message.tool_calls[0].model_dump()],
                },
                {
                    "role": "tool",
                    "tool_call_id": auto_call.choices[0].message.tool_calls[0].id,
                    "content": "18 C, sunny",
                },
            ]
            answered = client.chat.completions.create(
                model="smollm2",
                messages=history,
                tools=[weather],
                tool_choice="none",
                temperature=0,
                max_tokens=24,
            )
            with pytest.raises(openai.BadRequestError) as both:
                client.chat.completions.create(
                    model="smollm2",
                    messages=messages,
                    tools=[weather],
                    response_format={"type": "json_object"},
                )
            lc_auto = llm_required.bind_tools([weather]).invoke("Weather in Oslo?")
            llm = ChatOpenAI(model="smollm2", base_url=gateway.url + "/v1", api_key="unused", temperature=0)
            bound = llm.bind_tools([weather], tool_choice="get_weather").invoke("Weather in Rome?")
        finally:
            gateway.stop()
    call = named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "tool_calls" and named.choices[0].message.content is None
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])
    assert required.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")
    auto_calls = auto_call.choices[0].message.tool_calls
    assert auto_call.choices[0].finish_reason == "tool_calls" and auto_call.choices[0].message.content is None
    assert auto_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(auto_calls[0].function.arguments), listed["function"]["parameters"])
    auto_deltas = [c.choices[0].delta for c in auto_streamed if c.choices and c.choices[0].delta.tool_calls]
    assert [json.loads(call.function.arguments) for d in auto_deltas for call in d.tool_calls] == [
        json.loads(call.function.arguments) for call in auto_calls
    ]
    assert [c.choices[0].finish_reason for c in auto_streamed if c.choices][-1] == "tool_calls"
    text = auto_text.choices[0].message
    assert text.tool_calls is None and text.content and not text.content.startswith("<")
    assert answered.choices[0].message.content  # the history with a call and its result rendered
    assert "response_format and tools" in both.value.body["message"]
    assert lc_auto.content or lc_auto.tool_calls  # LangChain's default tool_choice: auto
    assert bound.tool_calls[0]["name"] == "get_weather" and bound.tool_calls[0]["args"]["city"]
    jsonschema.validate(bound_required.tool_calls[0]["args"], weather["function"]["parameters"])
    deltas = [c.choices[0].delta for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assembled = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)
    assert deltas[0].tool_calls[0].function.name == required.choices[0].message.tool_calls[0].function.name
    assert json.loads(assembled) == json.loads(required.choices[0].message.tool_calls[0].function.arguments)
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
