"""The container files: no Docker engine runs here, so check what can be checked: the compose
file parses and refers only to things that exist, and the commands it runs work when run directly."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from tokenfleet.transport.server.embedded import free_port

ROOT = Path(__file__).parents[2]


def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_refers_only_to_what_exists():
    c = compose()
    services, volumes = c["services"], set(c.get("volumes", {}))
    assert {"redis", "worker", "gateway", "model-init", "prometheus"} <= set(services)
    for name, svc in services.items():
        if "build" in svc:
            assert (ROOT / svc["build"] / "Dockerfile").is_file(), name
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in volumes, f"{name} mounts undeclared volume {source}"
    assert "--appendonly" in services["redis"]["command"]  # queued requests survive a restart
    worker_port = services["worker"]["command"][services["worker"]["command"].index("--metrics-port") + 1]
    scraped = (ROOT / "deploy" / "prometheus.yml").read_text()
    assert worker_port in scraped
    gateway = services["gateway"]["command"]
    assert gateway[gateway.index("--port") + 1] in scraped
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tokenfleet"]' in dockerfile and "COPY tokenfleet" in dockerfile


def test_compose_commands_work_when_run_directly(tmp_path, redis_url, prefix):
    """model-init's and the worker's exact commands, with the compose environment (paths and the
    Redis address mapped onto this machine)."""
    services = compose()["services"]
    models = tmp_path / "models"
    init = [a.replace("/models", str(models)) for a in services["model-init"]["command"]]
    done = subprocess.run(
        [sys.executable, "-m", "tokenfleet", *init], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    worker = services["worker"]
    env = {k: str(v).replace("/models", str(models)) for k, v in worker["environment"].items()}
    env.update(REDIS_URL=redis_url, TOKENFLEET_PREFIX=prefix)
    command = list(worker["command"])
    command[command.index("--metrics-port") + 1] = str(free_port())
    settings = subprocess.run(
        [sys.executable, "-m", "tokenfleet", *command, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert settings.returncode == 0, settings.stderr
    resolved = json.loads(settings.stdout)
    assert resolved["model"] == str(models / "tiny") and resolved["max_batch_size"] == 16  # online
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet", *command],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        submit = subprocess.run(
            [sys.executable, "-m", "tokenfleet", "submit", "--json", "--max-new-tokens", "3", "hello"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env},
        )
        assert submit.returncode == 0, submit.stderr
        assert len(json.loads(submit.stdout)["token_ids"]) == 3
        serve = [a.replace("/models", str(models)) for a in services["gateway"]["command"]]
        port = free_port()
        serve[serve.index("--port") + 1] = str(port)
        gateway = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet", *serve],
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            reply = _post_when_up(
                f"http://127.0.0.1:{port}/v1/completions", {"model": "tiny", "prompt": "hi"}
            )
            assert len(reply["choices"][0]["token_ids"]) == 16  # OpenAI's default max_tokens
        finally:
            gateway.terminate()
            gateway.wait(30)
    finally:
        proc.send_signal(signal.SIGTERM)
        logs, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, logs[-2000:]


def _post_when_up(url: str, body: dict, wait_s: float = 60) -> dict:
    import time

    import httpx

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return httpx.post(url, json={**body, "ignore_eos": True}, timeout=60).raise_for_status().json()
        except (httpx.TransportError, httpx.HTTPStatusError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
