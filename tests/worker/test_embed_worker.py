"""Embedding requests through the queue, against sentence-transformers' ``encode`` (float32, within
1e-5): all-MiniLM-L6-v2 served by a worker, asked through the client (sync and asyncio) with texts
of mixed lengths in one batch, token ids and Matryoshka ``dimensions``; malformed entries (empty,
oversized, wrong types, a generation request) fail alone while their batch-mates get vectors."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from conftest import reply_events

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.engines.embed.core import EmbedCore
from tokenfleet.engines.embed.model import Embedder
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import AsyncClient, Client
from tokenfleet.protocol import ErrorCode, Keys, pack

pytestmark = pytest.mark.integration

BATCHING = DynamicBatchingConfig(max_wait_ms=30, max_batch_size=16, max_seq_len=512, buckets=(32, 512))
TEXTS = [
    "A cat sits on the mat.",
    "Queues decouple the callers from the workers: nothing is lost when a worker dies mid-request.",
    "naïve café — 東京 🚀",
    "word " * 400,  # past the model's 256 tokens: truncated as sentence-transformers truncates
    "Short.",
    "The quick brown fox jumps over the lazy dog. " * 12,
]


@pytest.fixture(scope="module")
def embedder(minilm) -> Embedder:
    return Embedder(minilm)


@pytest.fixture(scope="module")
def expected(minilm) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm, device="cpu").encode(TEXTS, batch_size=32)


@pytest.fixture
def embed_worker(run_worker, embedder):
    return lambda: run_worker(BATCHING, core=EmbedCore(embedder, BATCHING), served_model_name="minilm")


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-5, np.abs(got - want).max()
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.99999


def test_client_vectors_equal_sentence_transformers(embed_worker, redis_url, prefix, minilm, expected, r):
    with embed_worker() as running:
        client = Client(redis_url, model=minilm, prefix=prefix)  # its tokenizer picks the buckets
        assert_close(np.asarray(client.embed(TEXTS)), expected)
        # no tokenizer here: the ``auto`` stream, a worker tokenizes and moves the text on
        bare = Client(redis_url, prefix=prefix)
        assert_close(np.asarray(bare.embed(TEXTS[:3])), expected[:3])
        # token ids are taken as the model's tokens, special ones included
        ids = running.core.embedder.tokenize(TEXTS[:2])
        assert_close(np.asarray(client.embed(ids)), expected[:2])
        short = np.asarray(client.embed(TEXTS, dimensions=64))
        want = torch.nn.functional.normalize(torch.from_numpy(expected[:, :64]), dim=1).numpy()
        assert_close(short, want)
        raw = np.asarray(client.embed(TEXTS[:2], normalize=False))
        assert np.linalg.norm(raw, axis=1).min() > 1.01  # MiniLM's own pooled vectors, before its Normalize
        # batches formed under max_wait_ms / max_batch_size, one bucket each: the 512 bucket's
        # four texts of 7 to 256 tokens went in one pass
        assert max(running.prefill_sizes) >= 4
        handle = client.submit(TEXTS[0], embed=True)
        handle.result(timeout=60)
        done = reply_events(r, prefix, handle.id)[-1]
        assert done.type == "done" and len(done.embedding) == 4 * 384 and done.completion_tokens == 0
        assert done.prompt_tokens == len(running.core.embedder.tokenize(TEXTS[:1])[0])
        running.assert_healthy()


def test_async_client_embeds(embed_worker, redis_url, prefix, minilm, expected):
    async def main() -> list:
        async with AsyncClient(redis_url, model=minilm, prefix=prefix) as client:
            return await client.embed(TEXTS, timeout=60)

    with embed_worker():
        assert_close(np.asarray(asyncio.run(main())), expected)


def test_malformed_entries_fail_alone(embed_worker, redis_url, prefix, minilm, expected, r):
    keys = Keys(prefix)
    with embed_worker() as running:
        client = Client(redis_url, model=minilm, prefix=prefix)
        stream = keys.shard_stream(512, "interactive", 0)
        bad = {
            "empty": {"id": "empty", "prompt": "", "embed": {}, "v": 4},
            "types": {"id": "types", "prompt": "x", "embed": {"dimensions": "64"}, "v": 4},
            "spec": {"id": "spec", "prompt": "x", "embed": "yes", "v": 4},
            "ids": {"id": "ids", "input_ids": [1, "2"], "embed": {}, "v": 4},
            "vocab": {"id": "vocab", "input_ids": [10**6], "embed": {}, "v": 4},
            "wide": {"id": "wide", "prompt": "x", "embed": {"dimensions": 385}, "v": 4},
            "pooling": {"id": "pooling", "prompt": "x", "embed": {"pooling": "last"}, "v": 4},
            "huge": {"id": "huge", "prompt": "x" * (10 << 20), "embed": {}, "v": 4},
            "strict": {"id": "strict", "prompt": "word " * 400, "embed": {"truncate": False}, "v": 4},
        }
        good = [client.submit(text, embed=True) for text in TEXTS]
        for body in bad.values():
            r.xadd(stream, {"m": pack(body)})
        # PROTOCOL.md's redis-cli form: plain fields, the auto stream
        plain = {"v": "4", "id": "plain", "prompt": TEXTS[0], "embed": "{}"}
        r.xadd(keys.auto_stream_of("interactive"), plain)
        generate = client.submit("write a poem")  # this fleet embeds: a generation request is refused
        # by the auto stream too: never routed (by BERT's tokens) to a generation fleet's bucket
        generate_auto = Client(redis_url, prefix=prefix).submit("write a poem")
        long_ids = client.submit(input_ids=[101] + [2000] * 300 + [102], embed=True)  # not cut
        # a text far past the bucket's reach by characters is still cut, not refused, here
        huge_text = client.embed(["word " * 5000])[0]
        vectors = np.asarray([h.result(timeout=60).embedding for h in good])
        assert_close(vectors, expected)
        for handle in (generate, generate_auto):
            with pytest.raises(RequestFailed) as refused:
                handle.result(timeout=60)
            assert refused.value.code == ErrorCode.INVALID_REQUEST
            assert "embedding model" in refused.value.message
        with pytest.raises(RequestFailed) as cut:
            long_ids.result(timeout=60)
        assert cut.value.code == ErrorCode.PROMPT_TOO_LONG
        from sentence_transformers import SentenceTransformer

        want = SentenceTransformer(minilm, device="cpu").encode(["word " * 5000])
        assert_close(np.asarray([huge_text]), want)
        for rid in ("empty", "types", "spec", "ids", "vocab", "wide", "pooling"):
            events = reply_events(r, prefix, rid)
            assert [e.type for e in events] == ["error"], rid
            assert events[0].code == ErrorCode.INVALID_REQUEST, (rid, events[0])
        done = client.result("plain", timeout=60)
        assert_close(np.asarray([done.embedding]), expected[:1])
        assert reply_events(r, prefix, "strict")[0].code == ErrorCode.PROMPT_TOO_LONG
        # 10 MB: too big to decode, dead-lettered (its id cannot be read without decoding it)
        dead = r.xrange(keys.dead_letter)
        assert len(dead) == 1 and b"larger than" in dead[0][1][b"reason"]
        running.assert_healthy()


def test_an_embed_call_that_fails_cancels_the_inputs_still_queued(redis_url, prefix, r):
    """No vectors come back from a call that raises (here a timeout, no worker serving): its
    requests are cancelled, not left queued for a worker to embed later."""
    from tokenfleet.errors import ResultTimeout

    client = Client(redis_url, prefix=prefix)
    with pytest.raises(ResultTimeout):
        client.embed(["first", "second"], timeout=0.5)
    ids = [fields[b"id"].decode() for _, fields in r.xrange(Keys(prefix).cancels)]
    assert len(ids) == 2 and all(r.exists(Keys(prefix).cancel(i)) for i in ids)

    async def asynchronously() -> list[str]:
        aio = AsyncClient(redis_url, prefix=prefix)
        try:
            with pytest.raises(ResultTimeout):
                await aio.embed(["third"], timeout=0.5)
        finally:
            await aio.close()
        return [fields[b"id"].decode() for _, fields in r.xrange(Keys(prefix).cancels)]

    assert len(asyncio.run(asynchronously())) == 3
