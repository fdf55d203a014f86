"""The sync client's one XREAD over every reply stream it follows, on a thread of its own, against
a real Redis: each follower gets its own entries in order, a new follower is not held up by a
read already blocked, and threads streaming many requests through one client read once per
worker step, not once per request."""

import os
import threading
import time

import pytest
import redis

from tokenfleet import protocol
from tokenfleet.errors import ResultTimeout
from tokenfleet.producer import Client
from tokenfleet.producer.thread_replies import ThreadedReplyReader
from tokenfleet.protocol import Keys, TokenEvent


def test_followers_get_their_own_entries_and_a_new_one_ends_a_blocked_read(redis_url, prefix, r):
    # a blocked read that ignored a new follower would hold it for read_block_ms: make that 30 s
    keys = Keys(prefix)
    reader = ThreadedReplyReader(redis.Redis.from_url(redis_url), keys, give_up_s=5, read_block_ms=30_000)
    first = reader.follow(keys.reply_stream("a"))
    time.sleep(0.2)  # the read is now blocked on stream a alone
    second = reader.follow(keys.reply_stream("b"))
    r.xadd(keys.reply_stream("b"), {"n": 1})
    started = time.monotonic()
    got_b = second.get(timeout=5)
    assert time.monotonic() - started < 2
    for n in range(3):
        r.xadd(keys.reply_stream("a"), {"n": n})
    got_a: list = []
    while len(got_a) < 3:
        got_a += first.get(timeout=5)
    assert r.exists(reader.wake_key)
    reader.close()
    assert [fields[b"n"] for _, fields in got_b] == [b"1"]
    assert [fields[b"n"] for _, fields in got_a] == [b"0", b"1", b"2"]
    assert not r.exists(reader.wake_key)  # close() removes the client's wake-up stream


def test_threads_streaming_through_one_client_read_once_per_step(
    run_worker, redis_url, prefix, model_path, reference
):
    prompts = ["Hello", "a b c", "queue", "stream token", "x y", "fleet", "redis", "zz"]
    new_tokens = 16
    streamed: dict[str, list[int]] = {}
    with Client(redis_url, model=str(model_path), prefix=prefix) as client:
        reads = 0
        xread = client.redis.xread

        def counting_xread(*args, **kwargs):
            nonlocal reads
            reads += 1
            return xread(*args, **kwargs)

        client.redis.xread = counting_xread  # type: ignore[method-assign]

        def one(prompt: str) -> None:  # a web app's request thread
            handle = client.submit(prompt, max_new_tokens=new_tokens, ignore_eos=True)
            streamed[prompt] = [t for chunk in handle.stream(timeout=120) for t in chunk.token_ids]

        with run_worker():
            threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(180)
    for prompt in prompts:
        want = reference.greedy(reference.ids(prompt), new_tokens, ignore_eos=True)
        assert streamed[prompt] == want, prompt
    # a read per request per token would be len(prompts) * new_tokens = 128
    assert reads <= 3 * new_tokens, reads


def test_events_time_out_after_the_events_that_came(redis_url, prefix, r):
    """A request whose worker went quiet mid-stream: its events are handed over, then the timeout."""
    request_id = "went-quiet"
    for index in range(2):
        r.xadd(Keys(prefix).reply_stream(request_id), protocol.encode_event(TokenEvent(index, [7], "x")))
    got = []
    with Client(redis_url, prefix=prefix) as client, pytest.raises(ResultTimeout):
        for event in client.events(request_id, timeout=0.5):
            got.append(event.index)
    assert got == [0, 1]


def test_a_second_reader_of_one_request_gets_every_event_too(redis_url, prefix, r):
    request_id = "read-twice"
    stream = Keys(prefix).reply_stream(request_id)
    for index in range(3):
        r.xadd(stream, protocol.encode_event(TokenEvent(index, [index], "x")))
    r.xadd(stream, protocol.encode_event(protocol.DoneEvent("length", 3, 3)))
    seen = lambda event: getattr(event, "index", "done")  # noqa: E731
    with Client(redis_url, prefix=prefix) as client:
        first = client.events(request_id, timeout=10)
        assert seen(next(first)) == 0  # following now, through the shared read
        second = [seen(e) for e in client.events(request_id, timeout=10)]  # a read of its own
        rest = [seen(e) for e in first]
    assert second == [0, 1, 2, "done"] and rest == [1, 2, "done"]


def test_a_read_refused_ends_every_follower_with_the_error(redis_url, prefix):
    keys = Keys(prefix)
    conn = redis.Redis.from_url(redis_url)
    reader = ThreadedReplyReader(conn, keys, give_up_s=5, read_block_ms=200)
    refused = redis.ResponseError("NOPERM no permission")

    def xread(*args, **kwargs):
        raise refused

    conn.xread = xread  # type: ignore[method-assign]
    inbox = reader.follow(keys.reply_stream("x"))
    assert inbox.get(timeout=5) is refused
    reader.close()


def test_a_forked_child_streams_with_its_own_reader(redis_url, prefix, r):
    """A client used before a fork (a pre-fork web server's workers): the parent's reader thread
    does not exist in the child, which starts its own instead of waiting on it forever."""
    stream = Keys(prefix).reply_stream("forked")
    with Client(redis_url, prefix=prefix) as client:
        parent = client.events("forked", timeout=30)
        r.xadd(stream, protocol.encode_event(TokenEvent(0, [1], "x")))
        assert next(parent).index == 0  # the parent's reader is running
        pid = os.fork()
        if pid == 0:  # the child: any failure is its exit status
            try:
                got = [getattr(e, "index", "done") for e in client.events("forked", timeout=10)]
                os._exit(0 if got == [0, 1, "done"] else 1)
            except BaseException:
                os._exit(2)
        r.xadd(stream, protocol.encode_event(TokenEvent(1, [2], "y")))
        r.xadd(stream, protocol.encode_event(protocol.DoneEvent("length", 1, 2)))
        _, status = os.waitpid(pid, 0)
        assert [getattr(e, "index", "done") for e in parent] == [1, "done"]
    assert os.waitstatus_to_exitcode(status) == 0
