"""What the dashboard reads and does, on a real Redis without a browser: the fleet's time series,
queue figures per stream, a request's state, dead letters' requeue rules, who may do what."""

from __future__ import annotations

import pytest

from tokenfleet import protocol
from tokenfleet.gateway.dashboard import dead_letters, fleet, lookup
from tokenfleet.gateway.dashboard.access import Access, Refused
from tokenfleet.protocol import GROUP, Keys
from tokenfleet.transport.series import SLOT_S, Tally, add_sample, read_series

pytestmark = pytest.mark.integration


def test_workers_tallies_sum_into_one_point_per_slot_and_expire(r, prefix):
    keys = Keys(prefix)
    now = 1_000_000 * SLOT_S + 3.0
    for queue_s, ttft_s in ((0.1, 0.2), (0.3, 0.4)):  # two workers, one request each
        tally = Tally(tokens=50)
        tally.start(queue_s, ttft_s)
        pipe = r.pipeline()
        add_sample(pipe, keys, tally.fields(), now)
        pipe.execute()
    assert 0 < r.ttl(keys.series(1_000_000)) <= 3600 + SLOT_S
    [point] = read_series(r, keys, now + SLOT_S, span_s=SLOT_S)
    assert point["t"] == 1_000_000 * SLOT_S
    assert point["tokens_per_s"] == 100 / SLOT_S
    assert point["requests_per_min"] == 2 * 60 / SLOT_S
    assert (point["queue_ms"], point["ttft_ms"], point["ttft_p50_ms"]) == (200.0, 300.0, 250.0)
    empty = read_series(r, keys, now + 3 * SLOT_S, span_s=SLOT_S)[0]
    assert (empty["tokens_per_s"], empty["ttft_ms"], empty["ttft_p50_ms"]) == (0.0, None, None)


def test_queue_rows_count_waiting_and_pending_per_stream_with_the_oldest_age(r, prefix):
    keys = Keys(prefix)
    shard = keys.shard_stream(64, "interactive", 3)
    r.xgroup_create(shard, GROUP, id="0", mkstream=True)
    for n in range(5):
        r.xadd(shard, {"id": f"q{n}"}, id=f"{1_000_000 + n}-0")
    r.xreadgroup(GROUP, "w1", {shard: ">"}, count=2)  # two taken, three waiting
    rows = {row["name"]: row for row in fleet.queues(r, keys, [64], now=1_000_010.0)}
    row = rows["64"]
    assert (row["waiting"], row["pending"], row["entries"]) == (3, 2, 5)
    assert row["oldest_waiting_s"] == pytest.approx(1_000_010.0 - 1_000.002, abs=0.1)
    assert [s["stream"] for s in row["shards"]] == [shard]
    assert rows["64:batch"]["waiting"] == 0 and rows["auto"]["waiting"] == 0


def test_a_request_is_found_where_it_is(r, prefix):
    keys = Keys(prefix)
    assert lookup.lookup(r, keys, "nobody")["state"] == "unknown"
    stream = keys.request_stream(64)
    r.sadd(keys.buckets, 64)  # a served bucket: its streams are looked through
    entry = r.xadd(stream, {"m": protocol.pack({"v": 1, "id": "waits", "prompt": "hi"})})
    found = lookup.lookup(r, keys, "waits")
    assert (found["state"], found["stream"], found["entry"]) == ("queued", stream, entry.decode())
    r.xgroup_create(stream, GROUP, id="0")
    r.xreadgroup(GROUP, "worker-7", {stream: ">"})
    r.set(keys.owner("waits"), f"{stream} {entry.decode()}")
    assert (lookup.lookup(r, keys, "waits")["state"], lookup.lookup(r, keys, "waits")["worker"]) == (
        "running",
        "worker-7",
    )


def test_a_dead_letter_is_not_requeued_over_an_id_that_another_entry_now_owns(r, prefix):
    keys = Keys(prefix)
    body = protocol.pack({b"m": protocol.pack({"v": 1, "id": "taken", "prompt": "hi"})})
    stream = keys.request_stream(64)
    letter = r.xadd(keys.dead_letter, {"stream": stream, "entry": "1-1", "code": "internal", "body": body})
    r.set(keys.owner("taken"), f"{stream} 2-2")  # the id was submitted again since
    with pytest.raises(Refused) as refused:
        dead_letters.requeue(r, keys, letter.decode())
    assert refused.value.status == 409 and "another entry" in refused.value.message
    r.delete(keys.owner("taken"))
    r.set(keys.reply_stream("taken"), "its old error reply")
    done = dead_letters.requeue(r, keys, letter.decode())
    assert done["request_id"] == "taken" and not r.exists(keys.reply_stream("taken"))
    assert r.xlen(keys.dead_letter) == 0 and r.xlen(stream) == 1
    assert r.xrange(stream)[0][1] == {b"m": protocol.pack({"v": 1, "id": "taken", "prompt": "hi"})}
    with pytest.raises(Refused) as gone:
        dead_letters.requeue(r, keys, letter.decode())
    assert gone.value.status == 404


def test_admins_act_viewers_look_and_an_open_gateway_still_refuses_actions():
    rules = Access(frozenset({"adm"}), frozenset({"look"}))
    assert rules.viewer("Bearer look").startswith("key:") and rules.admin("Bearer adm").startswith("key:")
    for caller, status in (("Bearer look", 403), ("Bearer wrong", 401), (None, 401)):
        with pytest.raises(Refused) as refused:
            rules.admin(caller)
        assert refused.value.status == status
    with pytest.raises(Refused):
        rules.viewer("Bearer wrong")
    open_gateway = Access(frozenset(), open_view=True)
    assert open_gateway.viewer(None) == "anonymous"
    with pytest.raises(Refused) as refused:
        open_gateway.admin("Bearer anything")
    assert refused.value.status == 403 and "--admin-keys" in refused.value.message


def test_tokenfleet_dashboard_alone_makes_up_an_admin_key_and_prints_it(redis_url, prefix):
    """Without keys, `tokenfleet dashboard` is never an open page that can requeue and delete: it
    makes up an admin key for the run and prints the page's address with it."""
    import os
    import re
    import subprocess
    import sys
    import time

    import httpx

    from tokenfleet.transport.server.embedded import free_port

    port = free_port()
    command = [sys.executable, "-m", "tokenfleet", "dashboard", "--port", str(port), "--prefix", prefix]
    env = {**os.environ, "REDIS_URL": redis_url}
    env.pop("TOKENFLEET_ADMIN_KEYS", None)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stderr.readline() for _ in range(2)]
        found = re.search(r"open (http://\S+)/dashboard#key=(\S+)", lines[1])
        assert found, lines
        base, key = found.groups()
        deadline = time.monotonic() + 30
        while True:
            try:
                me = httpx.get(f"{base}/dashboard/api/whoami", headers={"Authorization": f"Bearer {key}"})
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert me.status_code == 200 and me.json()["can_act"] and me.json()["fleets"] == [prefix]
        assert httpx.get(f"{base}/dashboard/api/overview").status_code == 401
        assert (
            httpx.get(f"{base}/dashboard/api/overview", headers={"Authorization": f"Bearer {key}"}).json()[
                "prefix"
            ]
            == prefix
        )
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()


def test_the_api_answers_bad_input_with_clear_errors_and_records_every_action(redis_url, prefix, r):
    from fastapi.testclient import TestClient

    from tokenfleet.gateway.dashboard import standalone_app

    keys = Keys(prefix)
    app = standalone_app(redis_url, [prefix], Access(frozenset({"adm"}), frozenset({"look"})))
    admin, viewer = {"Authorization": "Bearer adm"}, {"Authorization": "Bearer look"}
    with TestClient(app) as http:
        assert http.get("/dashboard/api/overview", headers=viewer).json()["prefix"] == prefix
        for path in ("/dashboard/api/requests/bad%20id", "/dashboard/api/dead/-"):
            assert http.get(path, headers=viewer).status_code == 400, path
        follow = http.get("/dashboard/api/requests/abc/follow?after=%2B", headers=viewer)
        assert follow.status_code == 400 and "after" in follow.json()["error"]["message"]
        assert http.get("/dashboard/api/overview?fleet=elsewhere", headers=viewer).status_code == 404
        assert http.post("/dashboard/api/dead/1-1/requeue", headers=viewer).status_code == 403
        gone = http.post("/dashboard/api/dead/1-1/requeue", headers=admin)
        assert gone.status_code == 404 and "no dead letter" in gone.json()["error"]["message"]
        r.xadd(keys.dead_letter, {"stream": keys.request_stream(64), "entry": "1-1", "code": "undecodable"})
        assert http.post("/dashboard/api/dead-all/requeue", headers=admin).json()["remaining"] == 1
        assert http.post("/dashboard/api/dead-all/delete", headers=admin).json() == {"deleted": 1}
        actions = http.get("/dashboard/api/audit", headers=viewer).json()["data"]
        assert [a["action"] for a in actions] == ["delete-all", "requeue-all", "requeue"]
        assert "refused" in actions[-1]["outcome"] and all(a["who"].startswith("key:") for a in actions)
