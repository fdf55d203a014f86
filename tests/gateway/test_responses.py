"""OpenAI's Responses API at the gateway, driven by the real `openai` package: background
responses retrieved until they end, streams (and a background stream resumed on another replica
with ``starting_after``), turns chained by ``previous_response_id``, cancel and delete, a
background response that outlives a kill -9 of its gateway and of its worker, and every field
the gateway cannot honour refused by name."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx
import openai
import pytest
from test_gateway import MODEL

from tokenfleet.config import DynamicBatchingConfig

pytestmark = pytest.mark.integration
# a byte-level tokenizer under a chat template: a short turn is a hundred tokens
BATCHING = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=16, max_seq_len=1024, buckets=(128, 512))


@pytest.fixture(scope="module")
def runner(chat_model):
    from conftest import make_runner

    return make_runner(chat_model)


def wait_for(client: openai.OpenAI, response_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        assert time.monotonic() < deadline, response
        time.sleep(0.1)


def chat_text(client: openai.OpenAI, messages: list, max_tokens: int) -> str:
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return chat.choices[0].message.content


def test_a_background_response_is_retrieved_until_it_completes(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        client = gateways().openai()
        created = client.responses.create(
            model=MODEL, input="hello there", instructions="be brief", max_output_tokens=12,
            temperature=0, background=True, metadata={"team": "a"},
        )  # fmt: skip
        assert created.status == "queued" and created.background and created.output == []
        done = wait_for(client, created.id)
        expected = chat_text(
            client,
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
            12,
        )
    assert done.status in ("completed", "incomplete") and done.id == created.id
    assert done.output_text == expected
    assert done.metadata == {"team": "a"} and done.instructions == "be brief"
    assert (
        done.usage.output_tokens >= 1
        and done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    )
    assert (done.status == "incomplete") == (done.usage.output_tokens == 12)


def test_streams_resume_with_starting_after_on_another_replica(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        first, second = gateways(), gateways()
        client = first.openai()
        ask = dict(model=MODEL, input="stream me", max_output_tokens=30, temperature=0)
        with client.responses.stream(**ask) as stream:  # get_final_response wants "completed"
            events = list(stream)
        final = events[-1].response
        whole = client.responses.create(**ask)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created" and events[-1].type in (
            "response.completed",
            "response.incomplete",
        )
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == final.output_text == whole.output_text

        created = client.responses.create(
            **ask, background=True, stream=True, extra_body={"ignore_eos": True}
        )
        seen = []
        for event in created:
            seen.append(event)
            if len(seen) == 8:
                break
        response_id = seen[0].response.id
        rest = httpx.get(
            f"{second.url}/v1/responses/{response_id}",
            params={"stream": "true", "starting_after": 7},
            timeout=60,
        )
        numbers = [
            json.loads(line[6:])["sequence_number"]
            for line in rest.text.splitlines()
            if line.startswith("data: ")
        ]
        again = second.openai().responses.retrieve(response_id, stream=True)
        replayed = list(again)
    assert numbers[0] == 8 and numbers == list(range(8, 8 + len(numbers)))
    assert [e.model_dump() for e in replayed[:8]] == [e.model_dump() for e in seen]
    assert replayed[-1].type == "response.incomplete" and replayed[-1].response.usage.output_tokens == 30
    assert len(replayed) == 8 + len(numbers)


def test_three_turns_chained_by_previous_response_id(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        client = gateways().openai()
        turns = ["one", "two", "three"]
        previous, messages, answers, cached = None, [], [], []
        for turn in turns:
            response = client.responses.create(
                model=MODEL, input=turn, previous_response_id=previous, max_output_tokens=6, temperature=0
            )
            messages.append({"role": "user", "content": turn})
            answers.append((response.output_text, chat_text(client, messages, 6)))
            messages.append({"role": "assistant", "content": response.output_text})
            previous = response.id
            cached.append(response.usage.input_tokens_details.cached_tokens)
        items = client.responses.input_items.list(previous, order="asc")
    assert all(ours == chat for ours, chat in answers)
    assert cached[2] > cached[0] >= 0  # the history's K/V, held by the prefix cache, counted
    roles = [(item.role, item.content[0].text) for item in items.data]
    assert roles == [(m["role"], m["content"]) for m in messages[:-1]]


def test_cancel_and_delete(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        client = gateways().openai()
        long = dict(
            model=MODEL,
            input="go on",
            max_output_tokens=200,
            background=True,
            extra_body={"ignore_eos": True},
        )
        running = client.responses.create(**long)
        cancelled = client.responses.cancel(running.id)
        assert cancelled.status == "cancelled"
        later = wait_for(client, running.id)
        assert later.status == "cancelled" and (later.usage is None or later.usage.output_tokens < 200)
        with pytest.raises(openai.BadRequestError):  # only background responses are cancelled
            client.responses.cancel(client.responses.create(model=MODEL, input="x", max_output_tokens=2).id)
        deleted = client.responses.delete(running.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(running.id)
        with pytest.raises(openai.NotFoundError) as chained:
            client.responses.create(model=MODEL, input="x", previous_response_id=running.id)
    assert deleted is None  # openai-python returns nothing for a delete
    assert chained.value.body["param"] == "previous_response_id"


REFUSED = [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"background": True, "store": False}, None),
]


def test_what_the_gateway_cannot_honour_is_refused_by_name(gateways):
    url = gateways().url + "/v1/responses"
    for extra, param in REFUSED:
        reply = httpx.post(url, json={"model": MODEL, "input": "hi", **extra}, timeout=30)
        assert reply.status_code == 400, (extra, reply.text)
        error = reply.json()["error"]
        assert param is None or (error["param"] or "").startswith(param), (extra, error)


def test_a_background_response_outlives_its_gateway_and_its_worker(gateways, redis_url, prefix, chat_model):
    """kill -9 of the gateway that took it and of the worker running it: another worker resumes
    it and another replica returns it, whole, with every token."""
    from conftest import worker_process

    flags = (
        "--buckets",
        "128,512",
        "--max-seq-len",
        "1024",
        "--served-model-name",
        MODEL,
        "--claim-idle-ms",
        "1000",
    )
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = [worker_process(chat_model, redis_url, prefix, *flags, **quiet)]
    try:
        first, second = gateways(), gateways()
        client = first.openai(timeout=120)
        deadline = time.monotonic() + 120
        while not client.models.list().data:  # the worker is up
            assert time.monotonic() < deadline and workers[0].poll() is None
            time.sleep(0.2)
        ask = dict(
            model=MODEL,
            input="outlive",
            max_output_tokens=150,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        reference = client.responses.create(**ask)
        created = client.responses.create(**ask, background=True)
        first.stop(signal.SIGKILL)
        other = second.openai(timeout=120)
        while other.responses.retrieve(created.id).status == "queued":
            time.sleep(0.02)
        workers[0].send_signal(signal.SIGKILL)  # while it generates
        workers[0].wait(10)
        partial = other.responses.retrieve(created.id)
        workers.append(worker_process(chat_model, redis_url, prefix, *flags, **quiet))
        done = wait_for(other, created.id, timeout=180)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait(10)
    assert partial.status == "in_progress" and len(partial.output_text) < len(done.output_text)
    assert done.status == "incomplete" and done.usage.output_tokens == 150
    assert done.output_text == reference.output_text
