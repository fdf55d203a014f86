"""Wire protocol: codec round trips, the plain-field form, validation and stable error codes."""

import msgpack
import pytest

from tokenfleet import protocol
from tokenfleet.errors import ProtocolError
from tokenfleet.protocol import DoneEvent, ErrorCode, Keys, Request
from tokenfleet.transport import scripts


def test_keys_share_one_prefix():
    k = Keys("p")
    assert k.request_stream(128) == "{p}:req:128"  # one hash tag: one cluster slot for all control keys
    assert k.auto_stream == "{p}:req:auto"
    assert k.max_queue == "{p}:max_queue"
    assert k.dead_letter == "{p}:dead"
    assert k.reply_stream("abc") == "p:reply:abc"  # no tag: replies spread over the cluster
    assert k.cancel("abc") == "p:cancel:abc"


def test_prefix_with_braces_or_globs_is_refused():
    for bad in ("a{b}", "a*", "", "a b"):
        with pytest.raises(ValueError):
            Keys(bad)


def test_msgpack_round_trip():
    req = Request(
        id="r1",
        input_ids=(0, 5, 6),
        max_new_tokens=9,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=3,
        stop=("\n\n",),
        stop_token_ids=(7,),
        ignore_eos=True,
        deadline_ms=1,
        reply_ttl_s=60,
    )
    assert protocol.decode_request(protocol.encode_request(req)) == req
    assert req.to_wire()["input_ids"] == [0, 5, 6]  # lists on the wire, as other languages send
    plain = Request(id="r2", prompt="hi").to_wire()  # unset options stay off the wire
    assert not {"input_ids", "seed", "stop", "stop_token_ids", "deadline_ms", "extra"} & set(plain)
    assert protocol.decode_request(protocol.encode_request(Request(id="r2", prompt="hi"))) == Request(
        id="r2", prompt="hi"
    )


def test_plain_fields_as_redis_cli_sends_them():
    fields = {
        b"v": b"1",
        b"id": b"cli-1",
        b"prompt": b"hello",
        b"max_new_tokens": b"8",
        b"temperature": b"0",
        b"stop": b'["\\n"]',
        b"ignore_eos": b"true",
    }
    req = protocol.decode_request(fields)
    assert (req.id, req.prompt, req.max_new_tokens, req.stop, req.ignore_eos) == (
        "cli-1",
        "hello",
        8,
        ("\n",),
        True,
    )


def err(fields) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        protocol.decode_request(fields)
    return info.value


def body(**kw) -> dict:
    return {b"m": msgpack.packb({"v": 1, "id": "x1", "prompt": "hi", **kw})}


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_new_tokens="ten"),
        dict(max_new_tokens=0),
        dict(max_new_tokens=10**9),
        dict(temperature=-1),
        dict(temperature=float("nan")),
        dict(top_p=0),
        dict(top_k=True),
        dict(stop="x" * 1000),
        dict(stop=[1, 2]),
        dict(stop_token_ids=["a"]),
        dict(ignore_eos="yes"),
        dict(prompt=123),
        dict(prompt=""),
        dict(input_ids=[1, 2]),  # both prompt and input_ids
        dict(reply_ttl_s=0),
        dict(priority="urgent"),
        dict(priority=1),
    ],
)
def test_invalid_fields_get_an_error_reply_with_stable_code(kw):
    e = err(body(**kw))
    assert e.code == ErrorCode.INVALID_REQUEST
    assert e.request_id == "x1" and not e.dead_letter


@pytest.mark.parametrize("ids", [[1, -2], [1, True], [2.0, 1], [1, 1 << 31], [1, "2"], [[1]]])
def test_input_ids_must_be_small_non_negative_ints(ids):
    e = err({b"m": msgpack.packb({"id": "x1", "input_ids": ids})})
    assert e.code == ErrorCode.INVALID_REQUEST


def test_input_ids_at_the_bounds_are_taken():
    fields = {b"m": msgpack.packb({"id": "x1", "input_ids": [0, (1 << 31) - 1]})}
    assert protocol.decode_request(fields).input_ids == (0, (1 << 31) - 1)


@pytest.mark.parametrize(
    "fields",
    [
        {b"m": b"\xc1\xc1 not msgpack"},
        {b"m": msgpack.packb([1, 2, 3])},
        {b"m": msgpack.packb({"id": "x"}) + b"trailing"},
        {b"id": b"\xff\xfe"},
        {b"m": msgpack.packb(msgpack.ExtType(1, b"code"))},
    ],
)
def test_undecodable_bodies_are_dead_lettered(fields):
    e = err(fields)
    assert e.dead_letter
    assert e.code == ErrorCode.UNDECODABLE


def test_missing_or_bad_id_is_dead_lettered():
    assert err({b"m": msgpack.packb({"prompt": "hi"})}).dead_letter
    assert err({b"m": msgpack.packb({"id": "has space", "prompt": "hi"})}).dead_letter
    assert err({b"m": msgpack.packb({"id": "x" * 200, "prompt": "hi"})}).dead_letter


def test_unknown_version_is_dead_lettered_but_keeps_the_id():
    e = err({b"m": msgpack.packb({"v": 99, "id": "abc", "prompt": "hi"})})
    assert e.dead_letter and e.code == ErrorCode.UNSUPPORTED_VERSION and e.request_id == "abc"


def test_unknown_fields_are_kept_aside_not_rejected():
    req = protocol.decode_request(body(future_field=[1, 2]))
    assert req.extra == {"future_field": [1, 2]}


def test_oversized_prompt_is_refused():
    e = err(body(prompt="x" * (protocol.MAX_PROMPT_BYTES + 1)))
    assert e.code == ErrorCode.INVALID_REQUEST


def test_salvage_request_id_from_a_broken_entry():
    assert protocol.salvage_reply({b"id": b"abc", b"max_new_tokens": b"x"})[0] == "abc"
    assert protocol.salvage_reply({b"m": b"\xc1"})[0] is None


def test_reply_events_round_trip():
    ev = DoneEvent("stop", 3, 4, {"ttft_ms": 1.0}, 7)
    assert protocol.decode_event(protocol.encode_event(ev)) == ev
    assert protocol.encode_event(ev)[b"type"] == b"done"


def test_protocol_md_holds_the_enqueue_script_word_for_word():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "PROTOCOL.md").read_text()
    assert scripts.ENQUEUE.strip() in doc


def test_priority_names_a_lane_and_the_default_stays_off_the_wire():
    req = protocol.validate_request({"id": "p1", "prompt": "hi", "priority": "batch"})
    assert req.priority == "batch" and req.lane == 1
    assert protocol.validate_request(req.to_wire()) == req
    default = protocol.validate_request({"id": "p2", "prompt": "hi"})
    assert default.priority == "interactive" and default.lane == 0 and "priority" not in default.to_wire()


# -- output controls ---------------------------------------------------------------------------


def test_output_controls_round_trip_as_version_2():
    from tokenfleet.protocol.output_controls import parse_response_format

    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    req = Request(
        id="oc",
        input_ids=(1, 2),
        min_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        logit_bias=((7, -100.0), (12, 3.5)),
        response_format=parse_response_format(
            {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        ),
        logprobs=3,
    )
    body = req.to_wire()
    assert body["v"] == 2 and body["logit_bias"] == {"7": -100.0, "12": 3.5}
    assert list(body["response_format"]["json_schema"]["schema"]["properties"]) == ["b", "a"]  # order kept
    assert protocol.decode_request(protocol.encode_request(req)) == req
    assert Request(id="plain", input_ids=(1,)).to_wire()["v"] == 1  # older workers still take the rest


def test_output_controls_in_the_plain_form():
    fields = {
        b"id": b"p",
        b"prompt": b"hi",
        b"logprobs": b"2",
        b"presence_penalty": b"1.5",
        b"logit_bias": b'{"5": 10}',
        b"response_format": b'{"type": "regex", "regex": "[0-9]+"}',
    }
    req = protocol.decode_request(fields)
    assert req.logprobs == 2 and req.presence_penalty == 1.5 and req.logit_bias == ((5, 10.0),)
    assert req.response_format.type == "regex" and req.response_format.source == "[0-9]+"
    text = protocol.decode_request({b"id": b"t", b"prompt": b"hi", b"response_format": b'{"type": "text"}'})
    assert text.response_format is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("logprobs", 21),
        ("logprobs", -1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("min_tokens", 100),  # above max_new_tokens (64 by default)
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", [1, 2]),
        ("response_format", {"type": "yaml"}),
        ("response_format", {"type": "json_schema"}),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": "{not json"}}),
        ("response_format", {"type": "regex", "regex": ""}),
        ("response_format", {"type": "grammar", "grammar": "x" * ((64 << 10) + 1)}),
    ],
)
def test_bad_output_controls_are_invalid_requests(field, value):
    e = err({b"m": msgpack.packb({"id": "bad", "prompt": "hi", field: value})})
    assert e.code == ErrorCode.INVALID_REQUEST and not e.dead_letter and e.request_id == "bad"
