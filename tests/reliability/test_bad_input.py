"""Bad input costs only itself: entries that cannot be decoded, values out of range or of the
wrong kind, nesting at any depth, integers that are not plain ASCII digits, ids that name no
reply key or are already in use, bodies over the size limit, keys of ours deleted or of the wrong
type. Each is answered with an error reply or dead-lettered (the dead letters capped, error
replies keeping the request's TTL), and the worker serves on. Real worker, real Redis."""

import json
import threading
import time

import msgpack
import pytest
from conftest import assert_one_terminal, reply_events
from reliability_helpers import BATCHING, deep, error_of, pending

from tokenfleet import protocol
from tokenfleet.errors import ProtocolError, RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, ErrorCode, Keys


def test_bad_requests_get_errors_or_dead_letters_and_worker_keeps_serving(
    run_worker, redis_url, prefix, r, model_path, reference
):
    keys = Keys(prefix)
    stream = keys.request_stream(16)
    with run_worker() as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        before = client.submit("before", max_new_tokens=4)
        r.xadd(
            stream,
            {"m": msgpack.packb({"v": 1, "id": "wrongtype", "prompt": "hi", "max_new_tokens": "many"})},
        )
        r.xadd(stream, {"m": msgpack.packb({"v": 1, "id": "toolong", "input_ids": [5] * 200})})
        r.xadd(stream, {"m": msgpack.packb({"v": 1, "id": "vocab", "input_ids": [0, 99999]})})
        r.xadd(
            stream, {"m": msgpack.packb({"v": 1, "id": "overcap", "prompt": "hi", "max_new_tokens": 5000})}
        )
        r.xadd(stream, {"m": b"\x93\x01\x02"})  # msgpack, but a list
        r.xadd(stream, {"m": b"\xc1garbage"})  # not msgpack at all
        r.xadd(stream, {"m": msgpack.packb({"v": 99, "id": "future", "prompt": "hi"})})
        r.xadd(keys.auto_stream, {"id": "autolong", "prompt": "x" * 500})
        after = client.submit("after", max_new_tokens=4)
        codes = {}
        for rid in ("wrongtype", "toolong", "vocab", "overcap", "future", "autolong"):
            with pytest.raises(RequestFailed) as info:
                client.result(rid, timeout=30)
            codes[rid] = info.value.code
        assert after.result(timeout=60).token_ids == reference.greedy(reference.ids("after"), 4)
        assert before.result(timeout=60).token_ids == reference.greedy(reference.ids("before"), 4)
        running.assert_healthy()
    assert codes == {
        "wrongtype": ErrorCode.INVALID_REQUEST,
        "toolong": ErrorCode.PROMPT_TOO_LONG,
        "vocab": ErrorCode.INVALID_REQUEST,
        "overcap": ErrorCode.INVALID_REQUEST,
        "future": ErrorCode.UNSUPPORTED_VERSION,
        "autolong": ErrorCode.PROMPT_TOO_LONG,
    }
    dead = r.xrange(keys.dead_letter)
    assert sorted(f[b"code"].decode() for _, f in dead) == [
        "undecodable",
        "undecodable",
        "unsupported_version",
    ]
    assert all(f[b"reason"] for _, f in dead)
    assert r.xpending(stream, GROUP)["pending"] == 0
    for rid in codes:
        assert_one_terminal(reply_events(r, prefix, rid))


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


def test_worker_survives_its_streams_being_deleted(run_worker, redis_url, prefix, r, model_path, reference):
    keys = Keys(prefix)
    with run_worker() as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 32, 64])
        assert client.submit("one", max_new_tokens=3).result(timeout=60).token_ids
        r.delete(*[keys.request_stream(b) for b in (16, 32, 64)], keys.auto_stream)
        threading.Event().wait(0.3)
        res = client.submit("two", max_new_tokens=3).result(timeout=60)
        assert res.token_ids == reference.greedy(reference.ids("two"), 3)
        running.assert_healthy()


def test_reply_key_of_the_wrong_type_does_not_wedge_the_worker(
    run_worker, redis_url, prefix, r, model_path, reference
):
    keys = Keys(prefix)
    r.set(keys.reply_stream("squatted"), "not a stream")
    with run_worker() as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        client.submit("hi", request_id="squatted", max_new_tokens=3)
        res = client.submit("after", max_new_tokens=3).result(timeout=60)
        assert res.token_ids == reference.greedy(reference.ids("after"), 3)
        running.assert_healthy()
    assert all(r.xpending(s, GROUP)["pending"] == 0 for s in keys.queue_streams(16))


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
