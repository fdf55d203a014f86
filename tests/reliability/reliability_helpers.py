"""What the reliability tests share: batching configs, a consumer that dies holding entries, bad
entries and the checks of what came back."""

import pytest

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.protocol import GROUP, Keys

# long enough for a request to run for a while (crash, cancel, deadline, trim)
LONG = DynamicBatchingConfig(max_wait_ms=10, max_batch_size=8, max_seq_len=4096, buckets=(16, 64))
# bad entries are answered at once
BATCHING = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=8, max_seq_len=256, buckets=(16, 64))


def assert_clean_reply(events, expected_ids):
    """Each token once, in order, exactly ``expected_ids``, then one ``done``."""
    tokens = [e for e in events if e.type == "token"]
    assert [e.index for e in tokens] == list(range(len(tokens))), "gap or duplicate"
    assert [t for e in tokens for t in e.ids] == expected_ids
    assert [e.type for e in events if e.type != "token"] == ["done"]


def ghost_takes(r, stream, count=100):
    """A consumer that reads entries and dies without acknowledging them."""
    return r.xreadgroup(GROUP, "ghost", {stream: ">"}, count=count)


def deep(depth: int) -> str:
    """A JSON list nested ``depth`` deep."""
    return "[" * depth + "]" * depth


def error_of(client, request_id, timeout=30):
    """The error the request ended with (it must end with one)."""
    with pytest.raises(RequestFailed) as info:
        client.result(request_id, timeout=timeout)
    return info.value


def pending(r, prefix):
    """Entries read but not acknowledged, over the streams of buckets 16, 64 and auto."""
    keys = Keys(prefix)
    return sum(
        r.xpending(stream, GROUP)["pending"]
        for b in (16, 64, "auto")
        for stream in keys.queue_streams(b)
        if r.exists(stream)
    )
