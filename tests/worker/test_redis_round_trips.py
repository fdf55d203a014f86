"""The worker's Redis exchange, turn by turn: a decode step costs one pipelined round trip (fewer
when a step has nothing to send), and a round trip or a script lost on the way loses no reply:
every event lands once, in index order. Real Redis, real tiny model."""

import threading

from conftest import RecordingCore, assert_one_terminal, reply_events

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.producer import Client
from tokenfleet.protocol import GROUP, DoneEvent, Keys, TokenEvent


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

    from tokenfleet.transport.outbox import Outbox
    from tokenfleet.transport.server.embedded import EmbeddedRedis

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
