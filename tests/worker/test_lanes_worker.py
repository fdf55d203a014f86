"""Priority lanes from the request to a real worker: the lane a request names (OpenAI bodies and
service tiers, bulk lines) and the streams it is queued on; a worker that starts interactive
requests before a flooded batch lane, without starving it."""

import json

import pytest

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.protocol import Keys
from tokenfleet.protocol.affinity import SHARDS


def test_lane_streams_and_queue_names():
    keys = Keys("p")
    assert keys.request_stream(128) == "{p}:req:128"
    assert keys.request_stream(128, "batch") == "{p}:req:128:batch"
    assert keys.shard_stream(128, "batch", 3) == "{p}:req:128:batch:s3"
    shards = [f"s{k}" for k in range(SHARDS)]
    assert keys.lane_streams([16, 32]) == [
        [
            *("{p}:req:16", *(f"{{p}}:req:16:{s}" for s in shards)),
            *("{p}:req:32", *(f"{{p}}:req:32:{s}" for s in shards)),
            "{p}:req:auto",
        ],
        [
            *("{p}:req:16:batch", *(f"{{p}}:req:16:batch:{s}" for s in shards)),
            *("{p}:req:32:batch", *(f"{{p}}:req:32:batch:{s}" for s in shards)),
            "{p}:req:auto:batch",
        ],
    ]
    assert Keys.queue_name("auto", "batch") == "auto:batch"


@pytest.mark.parametrize(
    "extra, bulk_lane, lane",
    [
        ({}, None, None),  # a live request with no say: the request's default, interactive
        ({}, "batch", "batch"),  # tokenfleet batch and the Batch API
        ({"service_tier": "flex"}, None, "batch"),  # OpenAI's cheaper, slower tier
        ({"service_tier": "priority"}, "batch", "interactive"),
        ({"priority": 5}, None, "batch"),  # vLLM's extension: above 0 is later
        ({"priority": 0}, "batch", "interactive"),
        ({"priority": "batch"}, None, "batch"),
    ],
)
def test_openai_bodies_choose_their_lane(extra, bulk_lane, lane):
    from tokenfleet.producer.openai.format import Completion, CompletionBody

    body = CompletionBody(model="m", prompt="hi", **extra)
    [(_, args)] = Completion.new("completion", body).submissions(body, lane=bulk_lane)
    assert args.get("priority") == lane


def test_an_unknown_lane_name_is_refused_by_the_openai_body():
    from pydantic import ValidationError

    from tokenfleet.producer.openai.format import CompletionBody

    with pytest.raises(ValidationError):
        CompletionBody(model="m", prompt="hi", priority="urgent")


def test_bulk_lines_default_to_the_batch_lane_unless_they_say(tmp_path):
    from tokenfleet.gateway.batch_job import parse
    from tokenfleet.producer.bulk import jobs_of

    plain = jobs_of([{"prompt": "a"}, {"prompt": "b", "priority": "interactive"}], "j", {"priority": "batch"})
    assert [job.requests[0][1]["priority"] for job in plain] == ["batch", "interactive"]
    line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "x"},
    }
    [job] = parse(json.dumps(line).encode(), "/v1/completions", "batch_1")
    assert job.requests[0][1]["priority"] == "batch"


def test_interactive_overtakes_a_flooded_batch_lane_on_a_real_worker(
    run_worker, redis_url, prefix, model_path
):
    from tokenfleet.producer import Client

    batching = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, max_seq_len=256, buckets=(16, 32, 64))
    running = run_worker(batching)
    core, steps, log = running.core, [0], []  # log: (what, step, lane, request id)
    real_add, real_step = core.add, core.step

    def add(seq, arrived):
        log.append(("add", steps[0], core.waiting_in(1), seq.request.id))
        return real_add(seq, arrived)

    def step(flush=False):
        free_slot = len(core.running()) < batching.max_batch_size
        out = real_step(flush=flush)
        for t in out.tokens:
            if t.index == 0:  # a request's first token: its first prefill ran in this step
                log.append(("start", steps[0], t.seq.request.priority, t.seq.request.id))
        prefilled = any(b.kind == "prefill" for b in out.batches)
        log.append(("free" if free_slot else "full", steps[0], prefilled, None))
        steps[0] += 1
        return out

    core.add, core.step = add, step
    client = Client(redis_url, model=str(model_path), prefix=prefix)
    with running:
        flood = [
            client.submit(f"bulk {i}", max_new_tokens=24, ignore_eos=True, priority="batch")
            for i in range(24)
        ]
        next(iter(flood[0].stream(timeout=60)))  # the batch lane is running, and 20 more wait
        urgent = [client.submit(f"now {i}", max_new_tokens=4, ignore_eos=True) for i in range(4)]
        results = [h.result(timeout=120) for h in urgent + flood]
    assert all(len(r.token_ids) == r.usage["completion_tokens"] for r in results)
    assert [len(r.token_ids) for r in results] == [4] * 4 + [24] * 24  # no starvation, nothing lost
    ids = {h.id for h in urgent}
    added = {rid: n for what, n, _, rid in log if what == "add" and rid in ids}
    # batch-lane requests were waiting in the worker (and more in Redis) when the first arrived
    assert min(waiting for what, _, waiting, rid in log if what == "add" and rid in ids) > 0
    started = {rid: n for what, n, _, rid in log if what == "start" and rid in ids}
    first_add, last_start = min(added.values()), max(started.values())
    overtaken = [
        rid
        for what, n, lane, rid in log
        if what == "start" and lane == "batch" and first_add <= n < last_start
    ]
    assert not overtaken, f"batch-lane requests started while interactive ones waited: {overtaken}"
    # whenever a slot was free and an interactive request waited, one started within a turn
    # (a step that follows a prefill decodes: prefills and decodes alternate)
    prefill_at = {n for what, n, prefilled, _ in log if what in ("free", "full") and prefilled}
    for what, n, _, _ in log:
        waiting = [rid for rid in ids if added[rid] <= n <= started[rid]]
        if what == "free" and waiting and n - 1 not in prefill_at:
            assert any(n <= started[rid] <= n + 1 for rid in waiting), [
                e for e in log if n - 4 <= e[1] <= n + 3
            ]
    assert any(lane == "batch" for what, n, lane, _ in log if what == "start" and n > last_start)
