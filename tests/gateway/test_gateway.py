"""The OpenAI-compatible gateway as users meet it: a real `tokenfleet serve` process, a real worker
and Redis, driven by the real `openai` package, curl and plain HTTP."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.producer import Client

pytestmark = pytest.mark.integration

BATCHING = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=32, max_seq_len=256, buckets=(16, 32, 64))
MODEL = "tiny"


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """(id, data) of each server-sent event."""
    event_id = None
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            yield event_id, line[6:]
            event_id = None


def python_client_ids(redis_url, prefix, model_path, prompt: str, max_new_tokens: int) -> list[int]:
    client = Client(redis_url, model=str(model_path), prefix=prefix)
    return client.submit(prompt, max_new_tokens=max_new_tokens, temperature=0).result(timeout=60).token_ids


def test_openai_clients_and_curl_get_the_python_clients_tokens(
    run_worker, gateways, redis_url, prefix, model_path
):
    with run_worker(BATCHING, served_model_name=MODEL):
        gateway = gateways()
        expected = python_client_ids(redis_url, prefix, model_path, "Hello gateway", 8)
        sync = gateway.openai()
        whole = sync.completions.create(model=MODEL, prompt="Hello gateway", max_tokens=8, temperature=0)
        assert whole.choices[0].token_ids == expected and whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 0
        streamed = list(
            sync.completions.create(
                model=MODEL,
                prompt="Hello gateway",
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert [t for c in streamed for choice in c.choices for t in choice.token_ids] == expected
        assert "".join(choice.text for c in streamed for choice in c.choices) == whole.choices[0].text
        assert streamed[-1].usage.completion_tokens == 8 and not streamed[-1].choices

        async def with_async() -> tuple[list[int], list[int]]:
            client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
            one = await client.completions.create(
                model=MODEL, prompt="Hello gateway", max_tokens=8, temperature=0
            )
            chunks = await client.completions.create(
                model=MODEL, prompt="Hello gateway", max_tokens=8, temperature=0, stream=True
            )
            ids = [t async for c in chunks for choice in c.choices for t in choice.token_ids]
            await client.close()
            return one.choices[0].token_ids, ids

        assert asyncio.run(with_async()) == (expected, expected)
        body = json.dumps(
            {"model": MODEL, "prompt": "Hello gateway", "max_tokens": 8, "temperature": 0, "stream": True}
        )
        curl = subprocess.run(
            [
                "curl",
                "-sN",
                gateway.url + "/v1/completions",
                "-H",
                "content-type: application/json",
                "-d",
                body,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        # OpenAI's shape exactly: data lines only (strict parsers such as vLLM's bench client fail
        # on anything else); resume ids only for a client that asks (the resume test below)
        assert not [line for line in curl.stdout.splitlines() if line and not line.startswith("data: ")]
        events = list(sse_events(iter(curl.stdout.splitlines())))
        assert events[-1] == (None, "[DONE]") and not any(event_id for event_id, _ in events)
        ids = [t for _, data in events[:-1] for c in json.loads(data)["choices"] for t in c["token_ids"]]
        assert ids == expected


def test_n_choices_fan_out_and_usage_counts_the_prompt_once(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        client = gateways().openai()
        out = client.completions.create(
            model=MODEL, prompt="fan out", max_tokens=5, n=3, temperature=0.9, seed=7
        )
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in out.choices}) > 1  # seeds differ per choice
        assert out.usage.completion_tokens == 15
        single = client.completions.create(model=MODEL, prompt="fan out", max_tokens=5)
        assert out.usage.prompt_tokens == single.usage.prompt_tokens


def test_errors_come_in_openais_shape_with_the_status_clients_act_on(
    run_worker, gateways, redis_url, prefix, r
):
    with run_worker(BATCHING, served_model_name=MODEL):
        gateway = gateways()
        client = gateway.openai()
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="x", max_tokens=0)
        assert bad.value.body["param"] == "max_tokens"
        for stream in (False, True):  # the worker's refusal, before any chunk: still a 400
            with pytest.raises(openai.BadRequestError) as long:
                client.completions.create(model=MODEL, prompt="word " * 200, max_tokens=4, stream=stream)
            assert long.value.body["code"] == "prompt_too_long"
        with pytest.raises(openai.NotFoundError) as unknown:  # another model is served: OpenAI's 404
            client.completions.create(model="not-here", prompt="x", max_tokens=4)
        assert unknown.value.body["code"] == "model_not_found" and unknown.value.body["param"] == "model"
    keyed = gateways("--api-keys", "k1,k2")
    with pytest.raises(openai.AuthenticationError):
        keyed.openai().models.list()
    ok = openai.OpenAI(base_url=keyed.url + "/v1", api_key="k2", max_retries=0)
    assert ok.models.list().data == []  # the worker stopped: it serves nothing now
    assert httpx.get(keyed.url + "/health").status_code == 200  # probes need no key
    odd = httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer ключ".encode()})
    assert odd.status_code == 401  # a key beyond ASCII is a wrong key, not a server error


def test_a_full_queue_is_429_and_a_request_past_its_time_504(gateways, prefix, r):
    from tokenfleet.protocol import GROUP, Keys, pack

    keys = Keys(prefix)  # a fleet that looks alive but never takes work: its queue fills
    r.hset(keys.workers, "ghost", pack({"model": MODEL, "buckets": [16, 32, 64], "seen": time.time() + 3600}))
    r.sadd(keys.buckets, 16, 32, 64)
    r.hset(keys.max_queue, mapping={"16": 1, "32": 1, "64": 1, "auto": 1})
    for bucket in (16, 32, 64):
        r.xgroup_create(keys.request_stream(bucket), GROUP, id="0", mkstream=True)
    gateway = gateways("--request-timeout-s", "1")
    first = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
    assert first.status_code == 504 and first.headers["x-should-retry"] == "false"
    full = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "b", "max_tokens": 2})
    assert full.status_code == 429 and full.headers["retry-after"]
    assert full.json()["error"]["type"] == "rate_limit_error"


def test_64_concurrent_streams_through_one_gateway_all_complete(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        gateway = gateways()

        async def one(client: httpx.AsyncClient, i: int) -> list[int]:
            body = {
                "model": MODEL,
                "prompt": f"stream {i}",
                "max_tokens": 6,
                "stream": True,
                "ignore_eos": True,
            }
            async with client.stream("POST", gateway.url + "/v1/completions", json=body, timeout=120) as resp:
                assert resp.status_code == 200
                events = [data async for data in _data_lines(resp)]
            assert events[-1] == "[DONE]"
            return [t for data in events[:-1] for c in json.loads(data)["choices"] for t in c["token_ids"]]

        async def all_of_them() -> list[list[int]]:
            async with httpx.AsyncClient() as client:
                return await asyncio.gather(*(one(client, i) for i in range(64)))

        assert all(len(ids) == 6 for ids in asyncio.run(all_of_them()))


async def _data_lines(resp: httpx.Response):
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            yield line[6:]


def test_a_stream_cut_by_a_killed_gateway_resumes_on_another_exactly_once(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        first, second = gateways(), gateways()
        body = {
            "model": MODEL,
            "prompt": "resume me",
            "max_tokens": 120,
            "temperature": 0,
            "ignore_eos": True,
        }
        headers = {"X-Tokenfleet-Resumable": "1"}  # ids on the events, and kept when the client drops
        got: list[int] = []
        text = ""
        last_id = None
        with httpx.stream(
            "POST", first.url + "/v1/completions", json={**body, "stream": True}, headers=headers
        ) as resp:
            for event_id, data in sse_events(resp.iter_lines()):
                got += [t for c in json.loads(data)["choices"] for t in c["token_ids"]]
                text += "".join(c["text"] for c in json.loads(data)["choices"])
                last_id = event_id
                if len(got) >= 20:
                    first.stop(signal.SIGKILL)
                    break
        assert 20 <= len(got) < 120 and last_id
        rest = httpx.post(
            second.url + "/v1/completions",
            json={**body, "stream": True},
            headers={**headers, "Last-Event-ID": last_id},
            timeout=120,
        )
        events = list(sse_events(iter(rest.text.splitlines())))
        assert events[-1] == (None, "[DONE]")
        chunks = [c for _, data in events[:-1] for c in json.loads(data)["choices"]]
        got += [t for c in chunks for t in c["token_ids"]]
        text += "".join(c["text"] for c in chunks)
        completion_id = last_id.split("/")[0]
        replay = httpx.get(f"{second.url}/v1/requests/{completion_id}", timeout=60).json()
        assert got == replay["choices"][0]["token_ids"] and len(got) == 120  # no gap, no repeat
        assert text == replay["choices"][0]["text"]


def test_a_retried_post_with_an_idempotency_key_generates_once(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL) as running:
        gateway = gateways()
        body = {"model": MODEL, "prompt": "only once", "max_tokens": 5, "temperature": 0}
        replies = [
            httpx.post(
                gateway.url + "/v1/completions", json=body, headers={"Idempotency-Key": "k-1"}, timeout=60
            )
            for _ in range(3)
        ]
        assert len({reply.json()["id"] for reply in replies}) == 1
        assert running.worker.requests_finished == 1


def test_a_200_line_batch_completes_in_openais_output_format(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        client = gateways().openai()
        lines = []
        bad = {  # lines that fail alone, in the error file; the rest of the batch runs
            17: {"prompt": "word " * 100},  # too long for every bucket: the worker refuses it
            30: {"max_tokens": 1_000_000},  # passes the body's check, refused when submitted
            31: {"max_tokens": -5},  # an invalid body
            32: {"tools": [{"type": "function", "function": {"name": "f"}}]},  # a field we do not honour
            150: {"prompt": "word " * 100},
        }
        for i in range(200):
            body = {
                "model": MODEL,
                "prompt": f"batch line {i}",
                "max_tokens": 3,
                "temperature": 0,
                **bad.get(i, {}),
            }
            lines.append({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body})
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 240
        while batch.status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch.errors
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (200, 195, 5)
        output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
        assert [row["custom_id"] for row in output] == [f"line-{i}" for i in range(200) if i not in bad]
        for row in output:
            assert set(row) == {"id", "custom_id", "response", "error"} and row["error"] is None
            assert row["response"]["status_code"] == 200
            completion = row["response"]["body"]
            assert (
                completion["object"] == "text_completion" and len(completion["choices"][0]["token_ids"]) == 3
            )
        assert [row["custom_id"] for row in errors] == [f"line-{i}" for i in bad]
        assert all(row["response"]["status_code"] == 400 for row in errors)
        codes = [row["response"]["body"]["error"]["code"] for row in errors]
        assert codes == [
            "prompt_too_long",
            "invalid_request",
            "invalid_request",
            "invalid_request",
            "prompt_too_long",
        ]
        assert "tools" in errors[3]["response"]["body"]["error"]["message"]
        twice = "".join(json.dumps(lines[0]) + "\n" for _ in range(2)).encode()  # a custom_id repeated
        unusable = client.batches.create(
            input_file_id=client.files.create(file=("twice.jsonl", twice), purpose="batch").id,
            endpoint="/v1/completions",
            completion_window="24h",
        )
        while unusable.status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, unusable
            time.sleep(0.5)
            unusable = client.batches.retrieve(unusable.id)
        assert unusable.status == "failed" and unusable.errors.data[0].line == 2


def test_models_health_and_metrics(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        gateway = gateways()
        assert [m.id for m in gateway.openai().models.list().data] == [MODEL]
        httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "m", "max_tokens": 2})
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'tokenfleet_gateway_requests_total{route="/v1/completions",status="200"}' in metrics


def test_a_client_that_goes_away_cancels_its_request(run_worker, gateways, redis_url, prefix):
    # long enough that the tiny model is still decoding when the gateway notices (~0.8 s), however
    # fast the engine gets: 200 tokens once finished first
    long_batching = dataclasses.replace(BATCHING, max_seq_len=4096)
    with run_worker(long_batching, served_model_name=MODEL):
        gateway = gateways()
        body = {"model": MODEL, "prompt": "go away", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as resp:
            events = sse_events(resp.iter_lines())
            _, data = next(events)
        request_id = json.loads(data)["id"] + ".0"  # choice 0's request
        result = Client(redis_url, prefix=prefix).result(request_id, timeout=60)
        assert result.finish_reason == "cancelled" and len(result.token_ids) < 4000
        # not streamed: the wait for the result notices the client leave, too
        body.update(stream=False, prompt="go away too")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gateway.url + "/v1/completions", json=body, timeout=0.3)
        time.sleep(1.0)  # the gateway polls for the disconnect every half second
        served = Client(redis_url, prefix=prefix)
        finishes = []
        for key in served.redis.scan_iter(match=f"{prefix}:reply:cmpl-*.0"):
            finishes.append(served.result(key.decode().split(":reply:")[1], timeout=60).finish_reason)
        assert finishes.count("cancelled") == 2


def test_a_cancelled_batch_stops_and_says_so(run_worker, gateways):
    with run_worker(BATCHING, served_model_name=MODEL):
        client = gateways().openai()
        body = {"model": MODEL, "prompt": "long", "max_tokens": 200, "ignore_eos": True}
        lines = [
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}
            for i in range(300)
        ]
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        while batch.status in ("validating",):
            time.sleep(0.1)
            batch = client.batches.retrieve(batch.id)
        assert client.batches.cancel(batch.id).status == "cancelling"
        deadline = time.monotonic() + 120
        while batch.status not in ("cancelled", "completed", "failed"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "cancelled" and batch.request_counts.completed < 300
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(batch.id)


def test_requests_in_flight_when_the_last_worker_dies_end_with_503_quickly(
    gateways, redis_url, prefix, tiny_model
):
    """The only worker is killed -9 mid-generation: the waiting (whole and streamed) requests end
    with a 503 ``model_not_served`` once its heartbeat is stale, not after the request timeout,
    and their requests are cancelled (a worker that comes back later does not run them)."""
    from conftest import worker_process

    worker = worker_process(
        tiny_model, redis_url, prefix, "--buckets", "16,64", "--served-model-name", MODEL,
        "--max-seq-len", "4096", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        gateway = gateways("--request-timeout-s", "600")
        client = gateway.openai(timeout=300)
        deadline = time.monotonic() + 120
        while not client.models.list().data:  # the worker is up
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.2)
        long = dict(model=MODEL, prompt="go on", max_tokens=3500, extra_body={"ignore_eos": True})
        stream = client.completions.create(**long, stream=True)
        next(iter(stream))  # generating
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(client.completions.create, **long)
            time.sleep(1.0)
            worker.send_signal(signal.SIGKILL)
            worker.wait(10)
            with pytest.raises(openai.APIError) as streamed:
                for _ in stream:
                    pass
            with pytest.raises(openai.APIStatusError) as waited:  # well before the 600 s timeout
                whole.result(timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert waited.value.status_code == 503 and waited.value.body["code"] == "model_not_served"
    assert "model_not_served" in str(streamed.value.body or streamed.value)
