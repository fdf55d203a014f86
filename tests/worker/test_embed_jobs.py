"""Bulk embedding jobs: ``tokenfleet embed`` over a JSONL of texts while the worker serving it is
killed -9 mid-job; another worker takes its texts over and every text is in the output exactly
once, in order, equal to sentence-transformers' ``encode`` within 1e-5 (float32). Interrupted
and run again, the command appends only what the output lacks."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import worker_process

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.engines.embed.core import EmbedCore
from tokenfleet.engines.embed.model import Embedder

pytestmark = pytest.mark.integration

BATCHING = DynamicBatchingConfig(max_wait_ms=20, max_batch_size=16, max_seq_len=512, buckets=(32, 512))
WORDS = (
    *("queue", "worker", "stream", "batch", "vector", "token", "fleet"),
    *("redis", "model", "search", "index", "text", "cache"),
)


def texts(n: int) -> list[str]:
    rng = random.Random(7)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))) for _ in range(n)]


def run_embed(redis_url, prefix, minilm, source, output) -> subprocess.Popen:
    command = [sys.executable, "-m", "tokenfleet", "embed", str(source), "-o", str(output)]
    command += ["--redis-url", redis_url, "--prefix", prefix, "--model", minilm, "--window", "64"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lines_of(path) -> list[dict]:
    """The output's complete lines (read while the job writes it: its last line may be half written)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


@pytest.mark.timeout(300)
def test_a_worker_killed_mid_job_leaves_every_text_embedded_once(
    run_worker, redis_url, prefix, minilm, tmp_path
):
    corpus = texts(400)
    source, output = tmp_path / "texts.jsonl", tmp_path / "vectors.jsonl"
    source.write_text("".join(json.dumps(t) + "\n" for t in corpus))
    first = worker_process(
        minilm,
        redis_url,
        prefix,
        *("--buckets", "32,512", "--max-seq-len", "512", "--max-batch-size", "16", "--claim-idle-ms", "1000"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    job = run_embed(redis_url, prefix, minilm, source, output)
    try:
        deadline = time.monotonic() + 180
        while len(lines_of(output)) < 40 and time.monotonic() < deadline:
            assert job.poll() is None, job.communicate()
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert len(lines_of(output)) < len(corpus), "the job ended before the kill"
        core = EmbedCore(Embedder(minilm), BATCHING)
        with run_worker(BATCHING, core=core, claim_idle_ms=1000) as second:
            out, err = job.communicate(timeout=180)
            assert job.returncode == 0, err
            assert "400 done" in out or "done" in out
            second.assert_healthy()
    finally:
        for process in (first, job):
            if process.poll() is None:
                process.kill()
    rows = lines_of(output)
    assert [row["index"] for row in rows] == list(range(len(corpus)))  # each once, in order
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(minilm, device="cpu").encode(corpus, batch_size=32)
    got = np.asarray([row["embedding"] for row in rows], dtype=np.float32)
    assert np.abs(got - want).max() <= 1e-5
    # run again: nothing is submitted, nothing appended
    again = run_embed(redis_url, prefix, minilm, source, output)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0 and f"{len(corpus)} already in" in out, (out, err)
    assert len(lines_of(output)) == len(corpus)
