"""Traces through the queue, as a collector sees them: an OTLP/HTTP receiver in the test takes
the spans of a real gateway and real workers. One trace id (the caller's ``traceparent``) spans
the gateway, the queue and the worker, with the queue span equal to the reply's ``queue_ms``;
a request resumed after a kill -9 shows both workers' spans under the gateway's."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from test_gateway import MODEL

from tokenfleet.protocol import DoneEvent, Keys, decode_event

pytestmark = pytest.mark.integration
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
RESUMED_ID = "5bf92f3577b34da6a3ce929d0e0e4737"


class Collector:
    """An OTLP/HTTP trace receiver: every span it is sent, as a dict."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list[dict] = []
        lock, spans = threading.Lock(), self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                export = ExportTraceServiceRequest()
                export.ParseFromString(self.rfile.read(int(self.headers["content-length"])))
                with lock:
                    for resource in export.resource_spans:
                        for scoped in resource.scope_spans:
                            spans.extend(_span(s) for s in scoped.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def named(self, name: str, trace_id: str = TRACE_ID) -> list[dict]:
        return [s for s in list(self.spans) if s["name"] == name and s["trace_id"] == trace_id]

    def wait_for(self, name: str, trace_id: str = TRACE_ID, timeout: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout
        while not self.named(name, trace_id):
            assert time.monotonic() < deadline, [s["name"] for s in self.spans]
            time.sleep(0.1)
        return self.named(name, trace_id)


def _span(span) -> dict:
    attributes = {
        a.key: a.value.string_value or a.value.int_value or a.value.double_value for a in span.attributes
    }
    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent": span.parent_span_id.hex(),
        "ms": (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6,
        "attributes": attributes,
    }


def done_event(r, prefix: str, request_id: str) -> DoneEvent:
    entries = r.xrange(Keys(prefix).reply_stream(request_id), min="1-0", max="1-0")
    event = decode_event(entries[0][1])
    assert isinstance(event, DoneEvent)
    return event


def test_one_trace_spans_gateway_queue_and_workers_across_a_kill_9(
    gateways, redis_url, prefix, tiny_model, r
):
    from conftest import worker_process

    collector = Collector()
    traced = ("--otlp-traces-endpoint", collector.url)
    flags = ("--buckets", "16,64", "--served-model-name", MODEL, "--claim-idle-ms", "1000", *traced)
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = [worker_process(tiny_model, redis_url, prefix, *flags, "--name", "first", **quiet)]
    try:
        gateway = gateways(*traced)
        client = gateway.openai(timeout=120)
        deadline = time.monotonic() + 120
        while not client.models.list().data:  # the worker is up
            assert time.monotonic() < deadline and workers[0].poll() is None
            time.sleep(0.2)
        short = client.completions.with_raw_response.create(
            model=MODEL, prompt="trace me", max_tokens=4, extra_headers={"traceparent": CALLER}
        )
        completion_id = short.parse().id
        post = collector.wait_for("POST /v1/completions")[0]
        queue = collector.wait_for("queue")[0]
        collector.wait_for("publish")
        timings = done_event(r, prefix, f"{completion_id}.0").timings

        resumed_caller = f"00-{RESUMED_ID}-00f067aa0ba902b8-01"
        body = {"model": MODEL, "prompt": "resume me", "max_tokens": 240, "ignore_eos": True, "stream": True}
        streamed: list[str] = []

        def read() -> None:
            with httpx.stream(
                "POST",
                gateway.url + "/v1/completions",
                json=body,
                headers={"traceparent": resumed_caller},
                timeout=None,
            ) as reply:
                streamed.extend(reply.iter_lines())

        reader = threading.Thread(target=read)
        reader.start()
        collector.wait_for("prefill", trace_id=RESUMED_ID)  # the first worker's spans are out
        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait(10)
        workers.append(worker_process(tiny_model, redis_url, prefix, *flags, "--name", "second", **quiet))
        reader.join(180)
        collector.wait_for("publish", trace_id=RESUMED_ID)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait(10)
    assert post["parent"] == "00f067aa0ba902b7"  # the caller's span is the gateway span's parent
    assert queue["parent"] == post["span_id"] and queue["attributes"]["tokenfleet.worker"] == "first"
    assert abs(queue["ms"] - timings["queue_ms"]) < 1.0, (queue["ms"], timings)
    assert {"prefill", "decode", "publish"} <= {
        s["name"] for s in collector.spans if s["parent"] == post["span_id"]
    }
    assert "data: [DONE]" in streamed  # the stream went on, through the second worker
    gateway_span = collector.named("POST /v1/completions", RESUMED_ID)[0]
    queues = collector.named("queue", RESUMED_ID)
    assert {q["attributes"]["tokenfleet.worker"] for q in queues} == {"first", "second"}
    assert {q["parent"] for q in queues} == {gateway_span["span_id"]}  # both workers under it
    (decode,) = collector.named("decode", RESUMED_ID)
    assert (
        decode["attributes"]["tokenfleet.worker"] == "second"
        and decode["attributes"]["tokenfleet.resumed_tokens"] > 0
    )


@pytest.mark.parametrize(
    "value, valid",
    [
        (CALLER, True),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", False),  # an all-zero trace id is invalid
        ("01-" + TRACE_ID + "-00f067aa0ba902b7-01", False),  # only version 00 is known
        (CALLER.upper(), False),
        (CALLER + "\n", False),
    ],
)
def test_a_traceparent_field_is_checked(value, valid):
    from tokenfleet.errors import ProtocolError
    from tokenfleet.protocol import validate_request

    body = {"id": "t-1", "prompt": "x", "traceparent": value}
    if valid:
        assert validate_request(body).traceparent == value
    else:
        with pytest.raises(ProtocolError, match="traceparent"):
            validate_request(body)
