"""Bad input costs only itself: poison entries, values that underflow sampling, a worker started
without Redis, a killed kernel build, bounded dead letters and reply TTLs, exact parsing,
duplicate ids. Real worker, real Redis."""

import json
import signal
import socket
import subprocess
import time

import msgpack
import pytest
import redis
from conftest import worker_process

from tokenfleet import protocol
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import ProtocolError, RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, ErrorCode, Keys

pytestmark = pytest.mark.integration

BATCHING = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=8, max_seq_len=256, buckets=(16, 64))


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def error_of(client, request_id, timeout=30):
    with pytest.raises(RequestFailed) as info:
        client.result(request_id, timeout=timeout)
    return info.value


def pending(r, prefix):
    keys = Keys(prefix)
    return sum(
        r.xpending(stream, GROUP)["pending"]
        for b in (16, 64, "auto")
        for stream in keys.queue_streams(b)
        if r.exists(stream)
    )


def test_nesting_at_every_depth_is_answered_and_the_worker_lives(
    run_worker, redis_url, prefix, r, model_path
):
    keys = Keys(prefix)
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    stream = keys.request_stream(16)
    with run_worker(BATCHING) as running:
        for depth in (1, 2, protocol.MAX_NESTING, protocol.MAX_NESTING + 1, 1000, 100_000):
            for field in ("input_ids", "stop", "stop_token_ids"):
                rid = f"deep-{field}-{depth}"
                r.xadd(stream, {"id": rid, "max_new_tokens": "4", field: deep(depth)})
                # msgpack form: nested lists in a known field and in an unknown one
                body = [[]]
                for _ in range(min(depth, 900)):
                    body = [body]
                r.xadd(stream, {"m": msgpack.packb({"id": rid + "-m", "input_ids": [1], "x": body})})
        for depth in (1, 2, protocol.MAX_NESTING, protocol.MAX_NESTING + 1, 1000, 100_000):
            for field in ("input_ids", "stop", "stop_token_ids"):
                code = error_of(client, f"deep-{field}-{depth}").code
                assert code in (ErrorCode.INVALID_REQUEST, ErrorCode.UNDECODABLE), (field, depth, code)
        valid = client.submit("still serving", max_new_tokens=3)
        assert len(valid.result(timeout=60).token_ids) == 3
        running.assert_healthy()
    assert pending(r, prefix) == 0


@pytest.mark.timeout(180)  # a minute or more on a busy 2-core machine
def test_a_worker_killed_while_taking_poison_entries_does_not_take_the_fleet_down(
    redis_url, prefix, r, tiny_model, model_path, tmp_path
):
    """Poison entries pour in; a worker is killed -9 while it holds some; a restarted worker
    (same name: its own pending list first) and a second one (claiming) take over: every entry is
    answered or dead-lettered, and valid requests complete."""
    keys = Keys(prefix)
    stream = keys.request_stream(16)
    flags = ["--buckets", "16,64", "--max-wait-ms", "5", "--claim-idle-ms", "500", "--max-batch-size", "8"]
    log = open(tmp_path / "workers.log", "w")  # noqa: SIM115 (closed below)
    first = worker_process(tiny_model, redis_url, prefix, "--name", "w-a", *flags, stdout=log, stderr=log)
    others = []
    try:
        deadline = time.monotonic() + 120
        while not r.hlen(keys.workers):
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        pipe = r.pipeline(transaction=False)
        for i in range(3000):
            pipe.xadd(stream, {"id": f"poison-{i}", "max_new_tokens": "2", "input_ids": deep(1000 + i % 7)})
        pipe.execute()
        deadline = time.monotonic() + 60
        while not r.xpending(stream, GROUP)["pending"]:
            assert time.monotonic() < deadline, "the worker never took the poison entries"
            time.sleep(0.001)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed_at = time.time()  # the killed w-a's registry entry stays, fresh for a few seconds
        others = [
            worker_process(tiny_model, redis_url, prefix, "--name", name, *flags, stdout=log, stderr=log)
            for name in ("w-a", "w-b")
        ]
        deadline = time.monotonic() + 180  # both up: the restarted one read its own pending list first
        while {n.decode() for n in r.hkeys(keys.workers)} != {"w-a", "w-b"} or any(
            protocol.unpack(raw)["seen"] <= killed_at for raw in r.hvals(keys.workers)
        ):
            assert time.monotonic() < deadline and all(p.poll() is None for p in others)
            time.sleep(0.1)
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        handles = [client.submit(f"valid {i}", max_new_tokens=3) for i in range(8)]
        assert all(len(h.result(timeout=120).token_ids) == 3 for h in handles)
        deadline = time.monotonic() + 120
        while pending(r, prefix) or any(
            g["lag"] for g in r.xinfo_groups(stream) if g["name"] == GROUP.encode()
        ):
            assert time.monotonic() < deadline, "entries left unanswered"
            time.sleep(0.1)
        assert all(p.poll() is None for p in others), "a worker died"
        assert error_of(client, "poison-0").code in (ErrorCode.UNDECODABLE, ErrorCode.TOO_MANY_ATTEMPTS)
    finally:
        for proc in [first, *others]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        log.close()
    assert [p.returncode for p in others] == [0, 0]


def test_sampling_values_that_underflow_never_fail_a_batch_mate(
    run_worker, redis_url, prefix, model_path, reference
):
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    with run_worker(
        DynamicBatchingConfig(max_wait_ms=300, max_batch_size=8, max_seq_len=256, buckets=(16, 64))
    ):
        greedy = client.submit("greedy mate", max_new_tokens=6, ignore_eos=True)
        odd = [
            client.submit("tiny temperature", max_new_tokens=6, temperature=1e-40, ignore_eos=True),
            client.submit("tiny top_p", max_new_tokens=6, temperature=1.0, top_p=1e-300, ignore_eos=True),
            client.submit(
                "both", max_new_tokens=6, temperature=1e-300, top_p=1e-300, seed=3, ignore_eos=True
            ),
        ]
        assert greedy.result(timeout=60).token_ids == reference.greedy(reference.ids("greedy mate"), 6, True)
        for handle in odd:
            assert len(handle.result(timeout=60).token_ids) == 6
    # a temperature that tiny samples the most likely token: greedy
    assert odd[0].result(timeout=5).token_ids == reference.greedy(reference.ids("tiny temperature"), 6, True)


def test_a_row_that_cannot_be_sampled_fails_alone():
    import torch

    from tokenfleet.engines.native.sampling.draw import choose_tokens

    class Row:
        def __init__(self, temperature):
            self.temperature, self.top_p, self.top_k, self.sampling_seed = temperature, 1.0, 0, None
            self.generated: list[int] = []
            self.request = type("R", (), {"seed": 1})()
            self.sampling_error = None

    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    rows = [Row(0.0), Row(1.0), Row(1.0)]
    chosen = choose_tokens(logits, rows)
    assert chosen[0] == int(logits[0].argmax()) and chosen[1] is None and isinstance(chosen[2], int)
    assert "NaN" in rows[1].sampling_error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_started_without_redis_waits_for_it(tiny_model, model_path, tmp_path, redis_server_binary):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    log = open(tmp_path / "worker.log", "w+")  # noqa: SIM115 (closed below)
    worker = worker_process(tiny_model, url, "tf-late", "--buckets", "16", stdout=log, stderr=log)
    server = None
    try:
        deadline = time.monotonic() + 120
        while "redis unavailable at start-up" not in (tmp_path / "worker.log").read_text():
            assert worker.poll() is None, "the worker exited without Redis"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert worker.poll() is None
        server = subprocess.Popen(
            [
                redis_server_binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
        )
        admin = redis.Redis.from_url(url)
        deadline = time.monotonic() + 120
        while True:
            try:
                if admin.hlen(Keys("tf-late").workers):
                    break
            except redis.ConnectionError:  # the server is still starting
                pass
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.2)
        client = Client(url, model=str(model_path), prefix="tf-late", buckets=[16])
        assert len(client.submit("late start", max_new_tokens=2).result(timeout=60).token_ids) == 2
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
        if server is not None:
            server.terminate()
            server.wait(10)
        log.close()


def test_dead_letters_are_capped_and_error_replies_keep_the_requests_ttl(
    run_worker, redis_url, prefix, r, model_path
):
    keys = Keys(prefix)
    stream = keys.request_stream(16)
    big = b"x" * (5 << 20)  # over the entry size limit
    with run_worker(BATCHING):
        r.xadd(stream, {"id": "huge", "prompt": big})
        r.xadd(stream, {"id": "short-ttl", "reply_ttl_s": "60", "max_new_tokens": "0", "prompt": "hi"})
        r.xadd(stream, {"m": msgpack.packb({"id": "short-ttl-m", "reply_ttl_s": 90, "top_p": 5})})
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        assert error_of(client, "huge").code == ErrorCode.UNDECODABLE
        assert error_of(client, "short-ttl").code == ErrorCode.INVALID_REQUEST
        assert error_of(client, "short-ttl-m").code == ErrorCode.INVALID_REQUEST
    assert 0 < r.ttl(keys.reply_stream("short-ttl")) <= 60
    assert 0 < r.ttl(keys.reply_stream("short-ttl-m")) <= 90
    assert 0 < r.ttl(keys.reply_stream("huge")) <= protocol.ERROR_REPLY_TTL_S
    ((_, dead),) = r.xrange(keys.dead_letter)
    assert len(dead[b"body"]) <= protocol.DEAD_LETTER_BODY_BYTES
    assert int(dead[b"body_bytes"]) > 5 << 20


@pytest.mark.parametrize("value", ["٣", "1_0", " 5 ", "5 ", "+5", "0x10", "5.0", "1e2"])
def test_plain_integers_are_ascii_digits_only(run_worker, redis_url, prefix, r, model_path, value):
    with run_worker(BATCHING):
        r.xadd(Keys(prefix).request_stream(16), {"id": "odd-int", "prompt": "hi", "max_new_tokens": value})
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        assert error_of(client, "odd-int").code == ErrorCode.INVALID_REQUEST


def test_an_id_with_a_trailing_newline_names_no_reply_key(run_worker, redis_url, prefix, r, model_path):
    keys = Keys(prefix)
    with run_worker(BATCHING):
        r.xadd(keys.request_stream(16), {"id": "nl\n", "prompt": "hi", "max_new_tokens": "2"})
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
        assert len(client.submit("after", max_new_tokens=2).result(timeout=60).token_ids) == 2
    assert not r.exists(keys.reply_stream("nl\n"))
    assert [f[b"code"] for _, f in r.xrange(keys.dead_letter)] == [b"invalid_request"]


def test_a_second_request_with_an_id_in_use_is_refused_never_merged(
    run_worker, redis_url, prefix, r, model_path
):
    keys = Keys(prefix)
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    with run_worker(BATCHING):
        first = client.submit("the first one", max_new_tokens=12, ignore_eos=True, request_id="same-id")
        client.submit("another prompt", max_new_tokens=3, ignore_eos=True, request_id="same-id")
        res = first.result(timeout=60)
        client.submit("after it finished", max_new_tokens=3, request_id="same-id")  # answered already
        deadline = time.monotonic() + 60
        while r.xlen(keys.dead_letter) < 2:  # both refused, whenever the worker gets to them
            assert time.monotonic() < deadline, r.xrange(keys.dead_letter)
            time.sleep(0.02)
    assert len(res.token_ids) == 12 and res.usage["completion_tokens"] == 12
    events = [protocol.decode_event(f) for _, f in r.xrange(keys.reply_stream("same-id"))]
    assert sum(len(e.ids) for e in events if e.type == "token") == 12
    assert [e.type for e in events].count("done") == 1
    assert [f[b"code"] for _, f in r.xrange(keys.dead_letter)] == [b"duplicate_id", b"duplicate_id"]
    assert pending(r, prefix) == 0


def test_repeated_dead_letter_warnings_are_rate_limited():
    import logging

    from tokenfleet.worker.ratelog import RateLimitedLog

    now = [0.0]
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("tokenfleet.test.ratelog")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    limited = RateLimitedLog(logger, interval_s=10, clock=lambda: now[0])
    for i in range(2000):
        now[0] = i * 0.01  # 2,000 in 20 s
        limited.log(logging.WARNING, "dead letter", "dead-lettering %d", i)
    assert len(records) == 2
    assert records[1].startswith("dead-lettering 1000") and "999 more" in records[1]


def test_json_and_msgpack_nesting_limits_hold_before_any_recursion():
    fields = {b"id": b"x", b"input_ids": deep(10**6).encode()}
    with pytest.raises(ProtocolError) as info:
        protocol.decode_request(fields)
    assert info.value.code == ErrorCode.UNDECODABLE
    assert protocol.salvage_reply(fields)[0] == "x"
    ok = protocol.decode_request({b"id": b"y", b"input_ids": json.dumps([1, 2]).encode()})
    assert ok.input_ids == (1, 2)
    too_deep = 1
    for _ in range(protocol.MAX_NESTING + 1):
        too_deep = [too_deep]
    nested = msgpack.packb({"id": "z", "input_ids": [1], "extra": too_deep})
    with pytest.raises(ProtocolError):
        protocol.decode_request({b"m": nested})
