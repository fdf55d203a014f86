"""The Node.js example client (PROTOCOL.md only: ioredis + @msgpack/msgpack) against a real worker."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).parents[2] / "examples" / "node"


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
def test_node_client_streams_tokens_from_a_real_worker(run_worker, redis_url, prefix, reference):
    if not (NODE_DIR / "node_modules").is_dir():
        if shutil.which("npm") is None:
            pytest.skip("needs npm to install the example's packages")
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            check=True,
            capture_output=True,
            timeout=300,
        )
    with run_worker():
        out = subprocess.run(
            ["node", "demo.mjs", "Hello from Node", "6"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix},
        )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["finish_reason"] == "length" and result["usage"]["completion_tokens"] == 6
    assert result["ids"] == reference.greedy(reference.ids("Hello from Node"), 6, ignore_eos=True)
