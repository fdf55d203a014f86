"""`tokenfleet serve` in a process of its own, for the gateway's tests and the SmolLM2 chat test
(beside conftest.py, so that any suite can import it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import openai

from tokenfleet.transport.server.embedded import free_port


class Gateway:
    """`tokenfleet serve` in a process of its own."""

    def __init__(self, redis_url: str, prefix: str, model_dir: str, *flags: str):
        self.port = free_port()
        self.clients: list[openai.OpenAI] = []
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "REDIS_URL": redis_url, "TOKENFLEET_PREFIX": prefix}
        command = [
            sys.executable,
            "-m",
            "tokenfleet",
            "serve",
            "--port",
            str(self.port),
            "--model",
            model_dir,
        ]
        # a file, not a pipe: a pipe nobody reads fills and blocks the server
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([*command, *flags], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.1)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def openai(self, **kw) -> openai.OpenAI:
        """A client of this gateway, closed when it stops (an unclosed one's sockets would warn,
        failing whichever test the garbage collector happens to run in)."""
        client = openai.OpenAI(**{"base_url": self.url + "/v1", "api_key": "unused", "max_retries": 0, **kw})
        self.clients.append(client)
        return client

    def stop(self, sig: int = signal.SIGTERM) -> None:
        for client in self.clients:
            client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.log.close()
