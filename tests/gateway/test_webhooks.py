"""Webhooks as a receiver meets them: a real HTTP server gets each event of background responses
and batches, signed per Standard Webhooks (openai-python's ``webhooks.unwrap`` verifies every
one), exactly once after deduplication by ``webhook-id`` although two gateway replicas deliver,
and on the third try when it answers 500 twice; an endpoint outside the allowlist is refused at
start."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from test_gateway import MODEL
from test_responses import BATCHING, wait_for

from tokenfleet.protocol import Keys
from tokenfleet.transport.server.embedded import free_port

pytestmark = pytest.mark.integration
SECRET = "whsec_" + base64.b64encode(b"a test secret of 32 bytes, no more").decode()


@pytest.fixture(scope="module")
def runner(chat_model):
    from conftest import make_runner

    return make_runner(chat_model)


class Receiver:
    """An HTTP server that records every POST and answers 500 to the first ``failures`` tries of
    each event (by its webhook-id)."""

    def __init__(self, failures: int):
        self.calls: list[tuple[dict[str, str], bytes, int]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                ident = self.headers["webhook-id"]
                with receiver.lock:
                    tries = sum(h["webhook-id"] == ident for h, _, _ in receiver.calls)
                    status = 500 if tries < failures else 200
                    receiver.calls.append(({k.lower(): v for k, v in self.headers.items()}, body, status))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def taken(self) -> dict[str, tuple[dict[str, str], bytes]]:
        """The events answered 200, by webhook-id (a receiver's deduplication)."""
        with self.lock:
            return {h["webhook-id"]: (h, b) for h, b, status in self.calls if status == 200}


def test_events_are_signed_delivered_once_and_retried(run_worker, gateways, redis_url, prefix, r):
    receiver = Receiver(failures=2)
    flags = (
        "--webhook-urls", f"http://127.0.0.1:{receiver.port}/hooks",
        "--webhook-hosts", f"127.0.0.1:{receiver.port}",
        "--webhook-secret", SECRET,
    )  # fmt: skip
    with run_worker(BATCHING, served_model_name=MODEL):
        first, second = gateways(*flags), gateways(*flags)  # both deliver: each event goes once
        client = first.openai()
        done = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, background=True)
        long = dict(max_output_tokens=300, background=True, extra_body={"ignore_eos": True})
        cancelled = client.responses.create(model=MODEL, input="go on", **long)
        client.responses.cancel(cancelled.id)
        line = {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "x", "max_tokens": 2},
        }
        uploaded = client.files.create(
            file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        assert wait_for(client, done.id).status in ("completed", "incomplete")
        deadline = time.monotonic() + 120
        while len(receiver.taken()) < 3:
            assert time.monotonic() < deadline, receiver.calls
            time.sleep(0.2)
        time.sleep(2)  # nothing more comes
        second_client = second.openai()
        ended = second_client.responses.retrieve(done.id).status
    unwrapper = openai.OpenAI(api_key="unused", webhook_secret=SECRET)
    events = {
        ident: unwrapper.webhooks.unwrap(body, headers) for ident, (headers, body) in receiver.taken().items()
    }
    got = sorted((e.type, e.data.id) for e in events.values())
    assert got == sorted(
        [(f"response.{ended}", done.id), ("response.cancelled", cancelled.id), ("batch.completed", batch.id)]
    )
    assert all(ident == event.id for ident, event in events.items())
    for ident in events:  # two 500s, then taken on the third try, with the same id; nothing after
        assert [status for h, _, status in receiver.calls if h["webhook-id"] == ident] == [500, 500, 200]
        assert r.hget(Keys(prefix).webhook(ident), "attempts") == b"2"


def test_an_endpoint_outside_the_allowlist_is_refused_at_start(redis_url, prefix):
    command = [
        sys.executable, "-m", "tokenfleet", "serve", "--port", str(free_port()),
        "--webhook-urls", "http://10.0.0.8/hooks", "--webhook-hosts", "hooks.example.com",
    ]  # fmt: skip
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "TOKENFLEET_PREFIX": prefix,
        "TOKENFLEET_WEBHOOK_SECRET": SECRET,
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "not in --webhook-hosts" in done.stderr and len(done.stderr.strip().splitlines()) <= 2, done.stderr


@pytest.mark.parametrize(
    "url, hosts, allowed",
    [
        ("https://hooks.example.com/x", "hooks.example.com:443", True),  # the scheme's own port
        ("https://hooks.example.com:8443/x", "hooks.example.com:443", False),
        ("http://[::1]:8080/x", "[::1]:8080", True),
        ("http://a.hooks.example.com/x", "*.example.com", True),
        ("http://example.com.evil.net/x", "*.example.com", False),
        ("http://evil.net\t.hooks.example.com/x", "*.example.com", False),  # a tab urlsplit drops
        ("http://evil.net\\.hooks.example.com/x", "*.example.com", False),  # a WHATWG host ends at \\
        ("http://user:pw@hooks.example.com/x", "hooks.example.com", False),
        ("ftp://hooks.example.com/x", "hooks.example.com", False),
        ("http://10.0.0.8/x", "", False),  # no allowlist: nothing goes anywhere
    ],
)
def test_the_allowlist_decides_where_webhooks_may_go(url, hosts, allowed):
    from tokenfleet.config.webhooks import checked_endpoints

    if allowed:
        assert checked_endpoints(url, hosts) == (url,)
    else:
        with pytest.raises(ValueError):
            checked_endpoints(url, hosts)
