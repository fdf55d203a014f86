"""Admission: every "can this request ever run here" check, in its documented order, as a value."""

import pytest

from tokenfleet.core.admission import Admission, Limits
from tokenfleet.protocol import ErrorCode, Request, smallest_bucket


def admission(**kw) -> Admission:
    limits = dict(
        buckets=(8, 16, 32),
        max_seq_len=40,
        max_new_tokens_cap=100,
        vocab_size=50,
        max_token_chars=4,
        kv_tokens_per_seq=36,
    )
    return Admission(Limits(**{**limits, **kw}))


@pytest.mark.parametrize(
    ("buckets", "length", "expected"),
    [((8, 16, 32), 1, 8), ((8, 16, 32), 8, 8), ((8, 16, 32), 9, 16), ((32, 8, 16), 17, 32), ((8,), 9, None)],
)
def test_the_smallest_bucket_that_holds_the_prompt(buckets, length, expected):
    assert smallest_bucket(buckets, length) == expected


def test_token_checks_in_their_documented_order():
    a = admission()
    assert a.check_tokens(0, 1).code == ErrorCode.INVALID_REQUEST
    assert a.check_tokens(33, 1).code == ErrorCode.PROMPT_TOO_LONG
    # too long for max_seq_len and for the cache at once: max_seq_len is named
    assert a.check_tokens(30, 11).code == ErrorCode.MAX_SEQ_LEN_EXCEEDED
    assert a.check_tokens(30, 7).code == ErrorCode.CACHE_TOO_SMALL
    assert a.check_tokens(30, 6) is None
    assert a.check_tokens(3, 4000).code == ErrorCode.MAX_SEQ_LEN_EXCEEDED


def test_request_checks_come_before_tokenizing():
    a = admission()
    over_cap = a.check_cap(Request(id="a", prompt="hi", max_new_tokens=101))
    assert over_cap.code == ErrorCode.INVALID_REQUEST and "cap of 100" in over_cap.message
    assert a.check_cap(Request(id="a", prompt="hi", max_new_tokens=100)) is None
    # 32 tokens of at most 4 characters each: a longer prompt cannot fit, whatever its tokens
    assert a.check_prompt_chars(Request(id="b", prompt="x" * 129)).code == ErrorCode.PROMPT_TOO_LONG
    assert a.check_prompt_chars(Request(id="c", prompt="x" * 128)) is None
    assert a.check_prompt_chars(Request(id="d", prompt="x" * 129), largest_bucket=64) is None


def test_input_ids_must_name_tokens_of_the_model():
    a = admission()
    assert a.check_ids([0, 49]) is None
    assert a.check_ids([0, 50]).code == ErrorCode.INVALID_REQUEST


def test_auto_engine_takes_vllm_only_on_an_accelerator_where_it_is_installed(monkeypatch):
    from tokenfleet import engines

    assert engines.choose_backend("native", "cuda") == ("native", "asked for")
    assert engines.choose_backend("vllm", "cpu") == ("vllm", "asked for")
    monkeypatch.setattr(engines, "vllm_installed", lambda: False)
    assert engines.choose_backend("auto", "auto")[0] == "native"
    monkeypatch.setattr(engines, "vllm_installed", lambda: True)
    backend, why = engines.choose_backend("auto", "cpu")
    assert backend == "native" and "CPU" in why
