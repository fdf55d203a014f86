"""``/v1/embeddings`` through a real gateway process, driven by openai-python (base64, its default,
and float) and LangChain's ``OpenAIEmbeddings``, unchanged: vectors equal sentence-transformers'
``encode`` within 1e-5 in float32. The embedding fleet has a prefix of its own
(``--embed-prefix``) beside a generation fleet on the gateway's prefix, which the route refuses."""

from __future__ import annotations

import secrets

import httpx
import numpy as np
import openai
import pytest
import redis
from conftest import RunningWorker

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.engines.embed.core import EmbedCore
from tokenfleet.engines.embed.model import Embedder
from tokenfleet.protocol import Keys

pytestmark = pytest.mark.integration

BATCHING = DynamicBatchingConfig(max_wait_ms=20, max_batch_size=16, max_seq_len=512, buckets=(32, 512))
TEXTS = [
    "A cat sits on the mat.",
    "Queues decouple the callers from the workers.",
    "naïve café — 東京 🚀",
    "The quick brown fox jumps over the lazy dog. " * 12,
]


@pytest.fixture(scope="module")
def expected(minilm) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm, device="cpu").encode(TEXTS)


@pytest.fixture
def embed_prefix(redis_url):
    name = f"tftest-{secrets.token_hex(4)}-emb"
    yield name
    client = redis.Redis.from_url(redis_url)
    keys = [k for pattern in Keys(name).patterns for k in client.scan_iter(match=pattern, count=1000)]
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def fleets(run_worker, runner, redis_url, embed_prefix, minilm):
    """A generation worker (``tiny``) on the test's prefix, an embedding worker (``minilm``) on
    ``embed_prefix``."""
    core = EmbedCore(Embedder(minilm), BATCHING)
    embedding = RunningWorker(
        runner, redis_url, embed_prefix, BATCHING, core=core, served_model_name="minilm"
    )
    with run_worker(served_model_name="tiny") as generating, embedding:
        yield generating, embedding


def assert_close(got, want) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5, np.abs(got - want).max()


def test_openai_and_langchain_embed_through_the_gateway(fleets, gateways, embed_prefix, minilm, expected):
    gateway = gateways("--embed-prefix", embed_prefix, "--embed-model", minilm)
    client = gateway.openai()
    default = client.embeddings.create(model="minilm", input=TEXTS)  # openai-python asks for base64
    assert_close([d.embedding for d in default.data], expected)
    assert [d.index for d in default.data] == list(range(len(TEXTS)))
    assert default.usage.prompt_tokens == default.usage.total_tokens > len(TEXTS)
    floats = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float")
    assert_close([floats.data[0].embedding], expected[:1])
    raw = httpx.post(
        gateway.url + "/v1/embeddings", json={"model": "minilm", "input": TEXTS, "encoding_format": "float"}
    ).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding" and raw["model"] == "minilm"
    short = client.embeddings.create(model="minilm", input=TEXTS, dimensions=64)
    want = expected[:, :64] / np.linalg.norm(expected[:, :64], axis=1, keepdims=True)
    assert_close([d.embedding for d in short.data], want)

    from langchain_openai import OpenAIEmbeddings

    # as with any server that is not OpenAI's: texts go as text, not as tiktoken's token ids
    lc = OpenAIEmbeddings(
        model="minilm", base_url=gateway.url + "/v1", api_key="unused", check_embedding_ctx_length=False
    )
    assert_close(lc.embed_documents(TEXTS), expected)
    assert_close([lc.embed_query(TEXTS[1])], expected[1:2])
    models = {m.id for m in client.models.list().data}
    assert {"minilm", "tiny"} <= models


def test_embeddings_refuse_what_they_cannot_serve(fleets, gateways, embed_prefix, minilm):
    gateway = gateways("--embed-prefix", embed_prefix)
    client = gateway.openai()
    with pytest.raises(openai.BadRequestError) as generating:
        client.embeddings.create(model="tiny", input="hello")
    assert generating.value.code == "model_not_embedding"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nobody", input="hello")
    cases = [
        ({"input": []}, "input"),
        ({"input": ""}, "empty"),
        ({"input": "x", "dimensions": 385}, "385"),
        ({"input": "x", "extra_field": 1}, "extra_field"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[10**6]]}, "vocabulary"),
    ]
    for fields, named in cases:
        response = httpx.post(gateway.url + "/v1/embeddings", json={"model": "minilm", **fields})
        assert response.status_code == 400, (fields, response.text)
        assert named in response.text, (fields, response.text)
    # no tokenizer given to the gateway: texts go by the auto stream, a worker tokenizes them
    assert len(client.embeddings.create(model="minilm", input=["a", "b"]).data) == 2


def test_batch_api_lines_for_embeddings(fleets, gateways, embed_prefix, minilm, expected):
    """OpenAI's Batch API with ``/v1/embeddings`` lines (a bad line fails alone): the output file's
    bodies are OpenAI's embeddings responses, equal to sentence-transformers'."""
    import base64
    import json
    import time

    gateway = gateways("--embed-prefix", embed_prefix)
    client = gateway.openai()
    line = {"method": "POST", "url": "/v1/embeddings"}
    lines = [
        {"custom_id": f"doc-{i}", **line, "body": {"model": "minilm", "input": text}}
        for i, text in enumerate(TEXTS)
    ]
    lines[1]["body"]["input"] = TEXTS[1:3]  # a line of two texts
    lines[1]["body"]["encoding_format"] = "base64"
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"model": "minilm"}})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("embed.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch.errors
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(lines), len(TEXTS), 1)
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [row["custom_id"] for row in output] == [f"doc-{i}" for i in range(len(TEXTS))]
    bodies = [row["response"]["body"] for row in output]
    assert all(row["response"]["status_code"] == 200 for row in output)
    assert_close(bodies[0]["data"][0]["embedding"], expected[0])
    pair = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in bodies[1]["data"]]
    assert_close(pair, expected[1:3])
    assert_close([bodies[3]["data"][0]["embedding"]], expected[3:4])
    assert bodies[1]["usage"]["prompt_tokens"] > 0 and bodies[1]["object"] == "list"
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert [row["custom_id"] for row in errors] == ["bad"] and "input" in json.dumps(errors[0])
