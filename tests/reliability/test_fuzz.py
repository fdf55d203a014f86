"""Thousands of malformed entries thrown at a running worker: it never dies, every entry is
answered or dead-lettered, and valid requests mixed in still complete correctly."""

import os
import time
import uuid

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tokenfleet import protocol
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, ErrorCode, Keys

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


@pytest.mark.timeout(180)  # a minute or more on a busy 2-core machine
def test_fuzzed_entries_never_kill_the_worker(run_worker, redis_url, prefix, r, model_path, reference):
    keys = Keys(prefix)
    streams = [keys.request_stream(16), keys.request_stream(64), keys.auto_stream]
    batching = DynamicBatchingConfig(
        max_wait_ms=2, max_batch_size=16, max_seq_len=128, buckets=(16, 64), max_new_tokens_cap=8
    )
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    sent = 0
    with run_worker(batching) as running:

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
            running.assert_healthy()

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
        running.assert_healthy()
    assert sent >= 1200
    for _, fields in r.xrange(keys.dead_letter):
        assert fields[b"reason"] and fields[b"code"]


# -- twenty thousand malformed entries, every class of bad input -----------------------------------

# What one bad entry may leave in Redis (docs/operations/size.md, "Redis memory"): a dead
# letter of at most DEAD_LETTER_BODY_BYTES of body plus its fields (only the newest ~10,000 are
# kept), an error reply stream until its TTL, and an owner key for an id that passed validation.
DEAD_LETTER_BYTES = protocol.DEAD_LETTER_BODY_BYTES + 512
ERROR_REPLY_BYTES = 5 * 1024  # a stream's first node is preallocated: ~4.7 KiB on Redis 7.0
OWNER_BYTES = 256


def malformed(i: int, rng) -> tuple[str, dict]:
    """The ``i``-th bad entry: the hardening issue's classes (deep nesting at every depth up to
    and past the limit, underflowing sampling values, lenient integers, ids with newlines, huge
    and duplicate ids) and more of our own (random bytes, non-map and extension-typed msgpack,
    invalid UTF-8, unknown versions, NaNs)."""
    depth = [1, 2, 3, 7, 8, 9, 12, 50, 1000, 20_000][i % 10]
    rid = f"bad-{i}"
    kind = i % 16
    if kind == 0:
        field = ("input_ids", "stop", "stop_token_ids")[i % 3]
        return "16", {"id": rid, "max_new_tokens": "2", field: "[" * depth + "1" + "]" * depth}
    if kind == 1:
        nested: object = [1]
        for _ in range(min(depth, 1000)):
            nested = [nested]
        key = ("input_ids", "stop", "extra")[i % 3]
        return "16", {"m": msgpack.packb({"id": rid, "prompt": "x", key: nested})}
    if kind == 2:
        return "16", {
            "id": rid,
            "prompt": "hi",
            "max_new_tokens": rng.choice(["٣", "1_0", " 5 ", "5\n", "0x5"]),
        }
    if kind == 3:
        return "16", {"id": rid + "\n", "prompt": "hi", "max_new_tokens": "2"}
    if kind == 4:
        return "16", {"m": rng.randbytes(rng.randint(0, 64))}
    if kind == 5:
        return "16", {"m": msgpack.packb(rng.choice([[rid], 5, "text", None, [1, 2, {"a": 1}]]))}
    if kind == 6:
        return "16", {"m": msgpack.packb({"id": rid, "prompt": msgpack.ExtType(5, b"xx")})}
    if kind == 7:
        return "16", {b"id": rid.encode(), b"prompt": b"\xff\xfe bad utf-8"}
    if kind == 8:
        return "16", {
            "m": msgpack.packb({"id": rid, "prompt": "hi", "v": rng.choice([0, 2, "1", None, 1.5])})
        }
    if kind == 9:
        return "16", {
            "id": rid,
            "prompt": "hi",
            "temperature": rng.choice(["nan", "inf", "-1", "1e999", "101"]),
        }
    if kind == 10:
        return "16", {"id": "x" * rng.choice([129, 1000]), "prompt": "hi"}
    if kind == 11:
        return "16", {"id": f"dup-{i % 50}", "prompt": "dup", "max_new_tokens": "1"}  # many share an id
    if kind == 12:
        return "auto", {"id": rid, "prompt": "y" * rng.choice([0, 100_000])}
    if kind == 13:
        return "16", {"id": rid, "input_ids": "[1, 2, 99999999]", "max_new_tokens": "2"}
    if kind == 14:
        return "16", {"m": msgpack.packb({"id": rid, "input_ids": [True, 1.5, "a"], "stop": [1]})}
    return "16", {"m": msgpack.packb({"id": rid, "prompt": "hi", "max_new_tokens": 10**9, "top_p": 0})}


def redis_bytes(r, prefix: str) -> int:
    keys = [k for pattern in Keys(prefix).patterns for k in r.scan_iter(match=pattern, count=1000)]
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key, samples=0)
    return sum(n or 0 for n in pipe.execute())


@pytest.mark.timeout(180)  # a minute or more on a busy 2-core machine
def test_twenty_thousand_malformed_entries_cost_only_themselves(
    run_worker, redis_url, prefix, r, model_path, reference
):
    import random

    rng = random.Random(27)
    total = int(os.environ.get("FUZZ_MALFORMED", "20000"))
    keys = Keys(prefix)
    batching = DynamicBatchingConfig(
        max_wait_ms=2, max_batch_size=32, max_seq_len=128, buckets=(16, 64), max_new_tokens_cap=8
    )
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    valid: list[tuple[str, object]] = []
    with run_worker(batching) as running:
        for chunk in range(0, total, 1000):
            pipe = r.pipeline(transaction=False)
            for i in range(chunk, min(total, chunk + 1000)):
                bucket, fields = malformed(i, rng)
                pipe.xadd(keys.request_stream(bucket), fields)
            pipe.execute()
            prompt = f"valid {chunk}"
            valid.append((prompt, client.submit(prompt, max_new_tokens=4)))
        for prompt, handle in valid:
            assert handle.result(timeout=300).token_ids == reference.greedy(reference.ids(prompt), 4)
        streams = [keys.request_stream(16), keys.request_stream(64), keys.auto_stream]
        for _ in range(1200):  # every entry taken and acknowledged: answered or dead-lettered
            groups = [
                g for s in streams if r.exists(s) for g in r.xinfo_groups(s) if g["name"] == GROUP.encode()
            ]
            if all(g["pending"] == 0 and not g["lag"] for g in groups):
                break
            running.thread.join(0.1)
        else:
            pytest.fail(f"entries left unanswered: {groups}")
        running.assert_healthy()
        time.sleep(6)  # the worker trims acknowledged entries every 5 s
    ended = {
        (metric.name, s.labels.get("code") or s.labels.get("reason")): s.value
        for metric in running.worker.metrics.registry.collect()
        if metric.name in ("tokenfleet_requests_failed", "tokenfleet_requests_finished")
        for s in metric.samples
        if s.name.endswith("_total")
    }
    # every entry ended exactly once: an error reply or dead letter, or done (the first of each
    # shared dup-* id, and the valid requests)
    assert sum(ended.values()) == total + len(valid), ended
    shared = [i % 50 for i in range(total) if i % 16 == 11]
    assert ended[("tokenfleet_requests_failed", ErrorCode.DUPLICATE_ID)] == len(shared) - len(set(shared))
    dead = r.xlen(keys.dead_letter)
    assert dead <= protocol.DEAD_LETTER_MAXLEN * 1.2
    used = redis_bytes(r, prefix)
    bound = min(total, protocol.DEAD_LETTER_MAXLEN) * DEAD_LETTER_BYTES + total * (
        ERROR_REPLY_BYTES + OWNER_BYTES
    )
    print(f"{total} bad entries: {used} bytes in Redis ({used / total:.0f} per entry), bound {bound}")
    assert used <= bound
