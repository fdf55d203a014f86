"""The worker on a real Redis server with a real tiny model: concurrency over several buckets,
exactly one terminal event per request, greedy equivalence, bad input, raw-Redis producers."""

import asyncio
import random
import subprocess
import threading

import msgpack
import pytest
from conftest import RecordingCore

from tokenfleet import protocol
from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import AsyncClient, Client
from tokenfleet.protocol import GROUP, DoneEvent, ErrorCode, Keys, TokenEvent, smallest_bucket

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "queue",
    "stream",
    "token",
    "fleet",
    "batch",
    "cache",
    "block",
    "worker",
    "redis",
]


def mixed_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9))) for _ in range(n)]


def reply_events(r, prefix, request_id):
    return [protocol.decode_event(f) for _, f in r.xrange(Keys(prefix).reply_stream(request_id))]


def assert_one_terminal(events):
    kinds = [e.type for e in events]
    assert kinds.count("done") + kinds.count("error") == 1 and kinds[-1] in ("done", "error"), kinds
    tokens = [e for e in events if e.type == "token"]
    assert [e.index for e in tokens] == list(range(len(tokens))), "gaps or duplicates in token indices"


@pytest.mark.parametrize(
    ("mode", "overlap_io"), [("dynamic", "auto"), ("continuous", "on"), ("continuous", "off")]
)
def test_concurrent_mixed_requests_over_buckets_match_generate(
    run_worker, redis_url, prefix, r, model_path, reference, mode, overlap_io
):
    batching = DynamicBatchingConfig(
        max_wait_ms=30, max_batch_size=8, max_seq_len=256, buckets=(16, 32, 64), mode=mode
    )
    prompts = mixed_prompts(24, seed=1)
    with run_worker(batching, overlap_io=overlap_io) as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        results = {}

        def submit_some(chunk):
            handles = [(p, client.submit(p, max_new_tokens=12)) for p in chunk]
            for p, h in handles:
                results[h.id] = (p, h.result(timeout=120))

        threads = [threading.Thread(target=submit_some, args=(prompts[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == len(prompts)
    buckets_used = {
        smallest_bucket(running.core.config.buckets, len(reference.ids(p))) for p, _ in results.values()
    }
    assert len(buckets_used) >= 2, "the workload should span several buckets"
    for request_id, (prompt, res) in results.items():
        assert res.token_ids == reference.greedy(reference.ids(prompt), 12), prompt
        assert res.usage == {
            "prompt_tokens": len(reference.ids(prompt)),
            "completion_tokens": len(res.token_ids),
        }
        assert_one_terminal(reply_events(r, prefix, request_id))
    assert max(running.prefill_sizes) > 1, "concurrent requests were never batched"
    # everything acknowledged: nothing left pending in any group
    for bucket in batching.buckets:
        assert all(r.xpending(s, GROUP)["pending"] == 0 for s in Keys(prefix).queue_streams(bucket))


def test_async_client_streams_and_result_replays_later(run_worker, redis_url, prefix, model_path, reference):
    async def go():
        async with AsyncClient(redis_url, model=str(model_path), prefix=prefix) as client:
            handles = [await client.submit(p, max_new_tokens=8) for p in ("Hello", "a b c")]
            streamed = []
            for h in handles:
                streamed.append([c async for c in h.stream(timeout=60)])
            later = [await client.result(h.id, timeout=5) for h in handles]
            return handles, streamed, later

    with run_worker():
        handles, streamed, later = asyncio.run(go())
    for prompt, chunks, res in zip(("Hello", "a b c"), streamed, later):
        assert (
            [t for c in chunks for t in c.token_ids]
            == res.token_ids
            == reference.greedy(reference.ids(prompt), 8)
        )
        assert "".join(c.text for c in chunks) == res.text
    # a client that never submitted anything reads the same result from the request id alone
    other = Client(redis_url, prefix=prefix)
    assert other.result(handles[0].id, timeout=5).token_ids == later[0].token_ids


def test_stream_interval_sends_several_tokens_per_event_and_loses_none(
    run_worker, redis_url, prefix, r, model_path, reference
):
    prompts = ["Hello", "a b c", "queue stream token"]
    with run_worker(stream_interval_ms=10_000):
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        handles = [client.submit(p, max_new_tokens=24, ignore_eos=True) for p in prompts]
        results = [h.result(timeout=120) for h in handles]
    for prompt, handle, res in zip(prompts, handles, results):
        assert res.token_ids == reference.greedy(reference.ids(prompt), 24, ignore_eos=True)
        events = reply_events(r, prefix, handle.id)
        tokens = [e for e in events if e.type == "token"]
        # the first token goes at once (TTFT), the other 23 wait for the interval: the end sends them
        assert [len(e.ids) for e in tokens] == [1, 23]
        assert [e.index for e in tokens] == [0, 1]
        assert "".join(e.text for e in tokens) == res.text
        assert events[-1].type == "done"


def test_prompt_without_tokenizer_goes_through_auto_stream(run_worker, redis_url, prefix, r, reference):
    with run_worker():
        client = Client(redis_url, prefix=prefix)  # no model: cannot tokenize
        handle = client.submit("route me please", max_new_tokens=6)
        res = handle.result(timeout=60)
    assert res.token_ids == reference.greedy(reference.ids("route me please"), 6)
    assert r.xpending(Keys(prefix).auto_stream, GROUP)["pending"] == 0


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


def test_raw_redis_cli_producer_is_served(run_worker, redis_url, prefix, r, reference, redis_cli):
    """Enqueue exactly as docs/PROTOCOL.md shows, with redis-cli (no tokenfleet code)."""
    cli = redis_cli
    with run_worker():
        subprocess.run(
            [
                cli,
                "-u",
                redis_url,
                "XADD",
                Keys(prefix).auto_stream,
                "*",
                "v",
                "1",
                "id",
                "cli-42",
                "prompt",
                "Hello from the shell",
                "max_new_tokens",
                "5",
            ],
            check=True,
            capture_output=True,
        )
        out = subprocess.run(
            [
                cli,
                "-u",
                redis_url,
                "XREAD",
                "BLOCK",
                "30000",
                "STREAMS",
                Keys(prefix).reply_stream("cli-42"),
                "0",
            ],
            check=True,
            capture_output=True,
        )
        assert b"token" in out.stdout
        events = []
        for _ in range(100):
            events = reply_events(r, prefix, "cli-42")
            if events and events[-1].type == "done":
                break
            threading.Event().wait(0.1)
    assert_one_terminal(events)
    ids = [t for e in events if e.type == "token" for t in e.ids]
    assert ids == reference.greedy(reference.ids("Hello from the shell"), 5)


def test_worker_with_nothing_to_do_stops_promptly(run_worker):
    with run_worker() as running:
        running.assert_healthy()


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


def counting_client(redis_url: str):
    """A real client whose connections count what they send: one write per round trip (a
    pipeline is packed into one), script calls included."""
    import redis

    class Counted(redis.Connection):
        sends = 0

        def send_packed_command(self, command, check_health=True):
            Counted.sends += 1
            return super().send_packed_command(command, check_health)

    return redis.Redis.from_url(redis_url, connection_class=Counted), Counted


def round_trips_per_decode_step(
    redis_url, prefix, runner, config_kw: dict, drive
) -> tuple[float, int, object]:
    """Run a worker whose Redis connections count their round trips while ``drive()`` submits
    and waits; returns round trips per decode step, the decode steps, and what ``drive``
    returned."""
    import dataclasses

    from tokenfleet.config import worker_config
    from tokenfleet.worker.loop import Worker

    counting, connection = counting_client(redis_url)
    at_decode: list[int] = []

    def on_batch(event):
        if event.kind == "decode":
            at_decode.append(connection.sends)

    from tokenfleet.engines.native.core import NativeCore

    batching = config_kw.pop("batching")
    config = dataclasses.replace(
        worker_config(redis_url=redis_url, prefix=prefix, **config_kw), batching=batching
    )
    core = RecordingCore(NativeCore(runner, config.batching), on_batch=on_batch)
    worker = Worker(config, core=core, client=counting)
    worker.setup()
    worker.setup_done = True
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        driven = drive()
    finally:
        worker.stop()
        thread.join(timeout=60)
    steps = len(at_decode) - 1
    return (at_decode[-1] - at_decode[0]) / steps, steps, driven


def test_a_decode_step_costs_one_redis_round_trip(runner, redis_url, prefix, model_path):
    """While a batch runs, the step's token events, the read of new work and the read of cancels
    share one pipelined round trip (three before they were merged)."""
    batching = DynamicBatchingConfig(
        max_wait_ms=50, max_batch_size=8, max_seq_len=128, buckets=(64,), mode="continuous"
    )

    def drive():
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        handles = [client.submit(f"prompt {i}", max_new_tokens=40, ignore_eos=True) for i in range(8)]
        return [h.result(timeout=120) for h in handles]

    per_step, steps, results = round_trips_per_decode_step(
        redis_url, prefix, runner, {"batching": batching}, drive
    )
    assert all(len(res.token_ids) == 40 for res in results)
    assert steps >= 38
    # one per step; the odd heartbeat or a turn that admitted new requests may add one
    assert per_step <= 1.2, f"{per_step:.2f} round trips per decode step"


def test_steps_with_nothing_to_send_share_a_round_trip(runner, redis_url, prefix, model_path):
    """Under a stream interval most steps send nothing: the round trip that would only read new
    work and cancels then goes every exchange_interval_ms, not after every step; cancels still act."""
    batching = DynamicBatchingConfig(
        max_wait_ms=50, max_batch_size=8, max_seq_len=256, buckets=(64,), mode="continuous"
    )

    def drive():
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        handles = [client.submit(f"prompt {i}", max_new_tokens=40, ignore_eos=True) for i in range(7)]
        doomed = client.submit("cancel me", max_new_tokens=150, ignore_eos=True)
        next(iter(doomed.stream(timeout=120)))  # running: its first token is out
        doomed.cancel()
        return [h.result(timeout=120) for h in handles], doomed.result(timeout=120)

    per_step, steps, (results, cancelled) = round_trips_per_decode_step(
        redis_url,
        prefix,
        runner,
        {"batching": batching, "stream_interval_ms": 10_000, "exchange_interval_ms": 50},
        drive,
    )
    assert all(len(res.token_ids) == 40 for res in results)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 150
    assert steps >= 38
    # a round trip per step before; now about one per 50 ms, and with the first and last tokens
    assert per_step <= 0.6, f"{per_step:.2f} round trips per decode step"


def test_replies_queued_during_a_lost_round_trip_go_after_the_ones_it_carried(redis_url, prefix, r):
    """Events queued while a round trip is in flight wait behind what it carries; if it is lost,
    its events are put back in front, so a request's events still land in index order."""
    import redis

    from tokenfleet.transport.outbox import Outbox

    outbox = Outbox(redis.Redis.from_url(redis_url), Keys(prefix))
    outbox.event("req", TokenEvent(0, [5], "a"), 60)
    lost = r.pipeline(transaction=False)
    assert outbox.queue_into(lost) > 0  # never executed: the connection "dropped"
    outbox.event("req", TokenEvent(1, [6], "b"))
    assert len(outbox) == 3  # two in flight (event + expiry), one queued behind
    outbox.restore()
    assert outbox.flush() == []
    assert [e.index for e in reply_events(r, prefix, "req")] == [0, 1]
    assert r.ttl(Keys(prefix).reply_stream("req")) > 0


def test_a_round_trip_lost_during_a_step_loses_no_token(
    run_worker, redis_url, prefix, r, model_path, reference, monkeypatch, caplog
):
    """Connection errors on the I/O thread, while steps compute: the worker backs off and sends
    the replies again; every request still gets each token once, in order, and one terminal."""
    import logging

    import redis

    # the I/O thread's round trips fail as redis-py gives up on a lost connection: the first before
    # anything ran, the next after Redis ran it all (the reply was lost), and so on
    failures = {"left": 4}
    execute = redis.client.Pipeline.execute

    def flaky_execute(self, raise_on_error=True):
        if not threading.current_thread().name.startswith("tokenfleet-io") or failures["left"] <= 0:
            return execute(self, raise_on_error)
        failures["left"] -= 1
        if failures["left"] % 2:
            self.reset()
        else:
            execute(self, raise_on_error)
        raise redis.ConnectionError("injected: connection lost")

    batching = DynamicBatchingConfig(
        max_wait_ms=20, max_batch_size=8, max_seq_len=128, buckets=(64,), mode="continuous"
    )
    caplog.set_level(logging.WARNING, logger="tokenfleet.worker.loop")
    # the I/O thread only runs while a batch does. Entries a lost reply had read are reclaimed;
    # the worker's own running ones, idle past claim_idle_ms while it backed off, must not be
    monkeypatch.setattr(redis.client.Pipeline, "execute", flaky_execute)
    with run_worker(batching, claim_idle_ms=500, overlap_io="on") as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        handles = [client.submit(f"prompt {i}", max_new_tokens=24, ignore_eos=True) for i in range(6)]
        results = [h.result(timeout=120) for h in handles]
        running.assert_healthy()
    assert failures["left"] == 0, "the injected failures were never hit"
    assert any("redis unavailable" in rec.getMessage() for rec in caplog.records)
    for i, (h, res) in enumerate(zip(handles, results)):
        assert res.token_ids == reference.greedy(reference.ids(f"prompt {i}"), 24, ignore_eos=True)
        assert_one_terminal(reply_events(r, prefix, h.id))
    assert all(r.xpending(s, GROUP)["pending"] == 0 for s in Keys(prefix).queue_streams(64))


def test_one_script_call_publishes_a_step_and_survives_a_lost_script_and_a_resend(prefix, tmp_path):
    """A step's events, expiry and acknowledgement go in one call of the publish script. If Redis
    lost its scripts (a restart) the call is refused whole and sent again once loaded; sending a
    step twice (a retry after a lost reply) stores each event once and reports nothing."""
    import redis

    from tokenfleet.transport.embedded import EmbeddedRedis
    from tokenfleet.transport.outbox import Outbox

    keys = Keys(prefix)
    with EmbeddedRedis(data_dir=str(tmp_path)) as server:
        r = redis.Redis.from_url(server.url)
        r.xgroup_create(keys.request_stream(16), GROUP, id="0", mkstream=True)
        entry_id = r.xadd(keys.request_stream(16), {b"m": b"x"}).decode()
        r.xreadgroup(GROUP, "w", {keys.request_stream(16): ">"})
        outbox = Outbox(r, keys)

        def queue_step():
            outbox.event("req", TokenEvent(0, [5], "a"), 60)
            outbox.event("req", DoneEvent("length", 1, 1, {}, 1), 60)
            outbox.ack(keys.request_stream(16), entry_id)

        queue_step()
        pipe = r.pipeline(transaction=False)
        assert outbox.queue_into(pipe) == 1  # one command for all five
        r.script_flush()
        assert outbox.sent(pipe.execute(raise_on_error=False)) == []
        queue_step()
        assert outbox.flush() == []  # the copies are refused at their ids, and not reported
        assert [e.type for e in reply_events(r, prefix, "req")] == ["token", "done"]
        assert 0 < r.ttl(keys.reply_stream("req")) <= 60
        assert r.xpending(keys.request_stream(16), GROUP)["pending"] == 0
