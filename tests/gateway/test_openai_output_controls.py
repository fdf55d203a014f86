"""OpenAI's output controls at the gateway, driven by the real `openai` package: logprobs in both
endpoints' shapes (whole and streamed), response_format, penalties and logit_bias passed on,
and every field the gateway cannot honour refused by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_gateway import BATCHING, MODEL

from tokenfleet.producer import Client

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "level": {"enum": ["low", "mid", "high"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["level", "count", "ok"],
}


def test_completion_logprobs_come_in_openais_shape_whole_and_streamed(
    run_worker, gateways, redis_url, prefix, model_path
):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    with run_worker(BATCHING, served_model_name=MODEL):
        client = gateways().openai()
        ours = Client(redis_url, model=str(model_path), prefix=prefix)
        expected = ours.submit("tell me", max_new_tokens=5, temperature=0, logprobs=3).result(timeout=60)
        args = dict(model=MODEL, prompt="tell me", max_tokens=5, temperature=0, logprobs=3)
        whole = client.completions.create(**args)
        streamed = list(client.completions.create(**args, stream=True))
        plain = client.completions.create(**{**args, "logprobs": None})
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs])
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in expected.token_ids]
    first_top = {tokenizer.decode([t], skip_special_tokens=False): v for t, v in expected.logprobs[0].top}
    assert lp.top_logprobs[0] == pytest.approx(first_top)  # keyed by text: tokens that decode alike merge
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [v for c in chunks for v in c.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert plain.choices[0].logprobs is None


def test_response_format_penalties_and_bias_reach_the_engine(
    run_worker, gateways, redis_url, prefix, model_path
):
    with run_worker(BATCHING, served_model_name=MODEL):
        client = gateways().openai()
        fmt = {"type": "json_schema", "json_schema": {"name": "reading", "schema": SCHEMA}}
        shaped = client.completions.create(
            model=MODEL, prompt="report", max_tokens=40, extra_body={"response_format": fmt}
        )
        ours = Client(redis_url, model=str(model_path), prefix=prefix)
        knobs = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"5": 8.0})
        expected = ours.submit("penalise me", max_new_tokens=8, temperature=0, **knobs).result(timeout=60)
        penalised = client.completions.create(
            model=MODEL, prompt="penalise me", max_tokens=8, temperature=0, **knobs
        )
        plain = client.completions.create(model=MODEL, prompt="penalise me", max_tokens=8, temperature=0)
        extensions = client.completions.create(
            model=MODEL,
            prompt="penalise me",
            max_tokens=8,
            temperature=0,
            extra_body={"repetition_penalty": 1.4, "min_tokens": 8},
        )
    assert shaped.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(shaped.choices[0].text), SCHEMA)
    assert penalised.choices[0].token_ids == expected.token_ids
    assert penalised.choices[0].token_ids != plain.choices[0].token_ids
    assert extensions.usage.completion_tokens == 8


def test_every_field_the_gateway_cannot_honour_is_refused_by_name(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        client = gateways().openai()
        chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        text = dict(model=MODEL, prompt="x", max_tokens=2)
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        refused = {
            "functions": lambda: client.chat.completions.create(**chat, functions=[tool["function"]]),
            "tools": lambda: client.chat.completions.create(
                **chat, tools=[tool], response_format={"type": "json_object"}
            ),
            "top_logprobs": lambda: client.chat.completions.create(**chat, top_logprobs=2),
            "response_format": lambda: client.chat.completions.create(
                **chat, response_format={"type": "yaml"}
            ),
            "min_p": lambda: client.completions.create(**text, extra_body={"min_p": 0.1}),
            "echo": lambda: client.completions.create(**text, echo=True),
            "logit_bias": lambda: client.completions.create(**text, logit_bias={"x": 1}),
        }
        for param, call in refused.items():
            with pytest.raises(openai.BadRequestError) as bad:
                call()
            body = bad.value.body
            assert (body["param"] or "").startswith(param) or param in body["message"], body
        bad_pattern = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}
        with pytest.raises(openai.BadRequestError) as grammar:
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": bad_pattern}}
            client.completions.create(**text, extra_body={"response_format": fmt})
        assert grammar.value.body["code"] == "invalid_grammar"
        kept = client.completions.create(
            **text, user="u1", extra_body={"metadata": {"k": "v"}, "store": False}
        )
        assert kept.usage.completion_tokens == 2
