"""Thousands of malformed entries thrown at a running worker: it never dies, every entry is
answered or dead-lettered, and valid requests mixed in still complete correctly."""

import os
import uuid

import msgpack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tokenfleet import protocol
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, Keys

FIELDS = [
    "v",
    "id",
    "prompt",
    "input_ids",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "deadline_ms",
    "reply_ttl_s",
]


def texts(max_size, categories=None):
    """Any text msgpack can carry: UTF-8, so no lone surrogates."""
    if categories:
        return st.text(alphabet=st.characters(categories=categories), max_size=max_size)
    return st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=max_size)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    texts(40),
    st.binary(max_size=40),
    texts(20, categories=["Co", "Zs", "Mn", "So", "Cc", "Cf"]),  # odd unicode: private use, marks, controls
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(texts(8), inner, max_size=4),
    max_leaves=12,
)
text = texts(200)
ids = st.one_of(st.uuids().map(lambda u: u.hex), text, st.integers(-(2**63), 2**63 - 1), st.none())
near_valid = st.fixed_dictionaries(
    {"id": ids},
    optional={name: values for name in FIELDS if name != "id"}
    | {
        "prompt": text,
        "input_ids": st.lists(st.integers(0, 400), max_size=40),
        "max_new_tokens": st.integers(-5, 40),
        "v": st.sampled_from([1, 1, 1, 0, 2, "1"]),
    },
)


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


entries = st.one_of(
    near_valid.map(lambda d: {b"m": pack(d)}),  # msgpack form, typed junk
    near_valid.map(
        lambda d: {k.encode(): str(v).encode() for k, v in d.items()} or {b"x": b""}
    ),  # plain form
    st.dictionaries(st.binary(min_size=1, max_size=12), st.binary(max_size=300), min_size=1, max_size=6),
    st.binary(max_size=400).map(lambda b: {b"m": b}),  # random bytes as a body
    values.map(lambda v: {b"m": pack(v)}),  # msgpack, but not a request map
    st.integers(1, 3 * protocol.MAX_PROMPT_BYTES // 2).map(
        lambda n: {b"id": b"big-" + str(n).encode(), b"prompt": b"x" * n}
    ),
)


def test_fuzzed_entries_never_kill_the_worker(run_worker, redis_url, prefix, r, model_path, reference):
    keys = Keys(prefix)
    streams = [keys.request_stream(16), keys.request_stream(64), keys.auto_stream]
    batching = DynamicBatchingConfig(max_wait_ms=2, max_batch_size=16, max_seq_len=128, buckets=(16, 64))
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    sent = 0
    with run_worker(batching, max_new_tokens_cap=8) as running:

        @settings(
            max_examples=int(os.environ.get("FUZZ_EXAMPLES", "30")),
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            phases=[Phase.generate],
        )  # no shrinking against a live worker: report as found
        @given(batch=st.lists(st.tuples(st.sampled_from(streams), entries), min_size=40, max_size=100))
        def throw(batch):
            nonlocal sent
            pipe = r.pipeline(transaction=False)
            for stream, fields in batch:
                pipe.xadd(stream, fields)
            pipe.execute()
            sent += len(batch)
            prompt = f"valid {uuid.uuid4().hex[:6]}"
            handle = client.submit(prompt, max_new_tokens=4)
            assert handle.result(timeout=120).token_ids == reference.greedy(reference.ids(prompt), 4)
            assert running.thread.is_alive()

        throw()
        # everything thrown was taken and acknowledged: nothing waits, nothing is pending
        deadline_ok = False
        for _ in range(200):
            groups = [next(g for g in r.xinfo_groups(s) if g["name"] == GROUP.encode()) for s in streams]
            if all(g["pending"] == 0 and not g["lag"] for g in groups):
                deadline_ok = True
                break
            running.thread.join(0.05)
        assert deadline_ok, groups
        assert running.thread.is_alive()
    assert sent >= 1200
    for _, fields in r.xrange(keys.dead_letter):
        assert fields[b"reason"] and fields[b"code"]
