"""Priority lanes: the interactive lane goes first, the batch lane is never starved, and in
continuous mode a full KV pool gives way to a higher lane by preempting a lower one."""

import json
import time
import zlib

import pytest
from conftest import TEST_DEVICE, make_runner

from tokenfleet.batcher import Batcher, PendingRequest
from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig
from tokenfleet.core.lanes import pick_victim, victims_for
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.core import NativeCore
from tokenfleet.kvcache.allocator import BlockAllocator
from tokenfleet.protocol import Keys, Request
from tokenfleet.protocol.affinity import SHARDS

INTERACTIVE, BATCH = 0, 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def batcher(mix_buckets=False, mode="continuous", promote_after_s=30.0, max_batch_size=4):
    clock = FakeClock()
    cfg = DynamicBatchingConfig(
        max_wait_ms=0,
        max_batch_size=max_batch_size,
        max_seq_len=64,
        buckets=(8, 16),
        mix_buckets=mix_buckets,
        mode=mode,
        promote_after_s=promote_after_s,
    )
    return Batcher(cfg, clock), clock


def add(b, clock, key, lane, length=4):
    b.add(PendingRequest(key, length, 4, clock(), lane=lane))


@pytest.mark.parametrize("mix_buckets", [False, True])
def test_interactive_goes_before_older_batch_work_and_lanes_never_mix(mix_buckets):
    b, clock = batcher(mix_buckets)
    for i in range(3):
        add(b, clock, f"b{i}", BATCH)
    clock.now += 1
    add(b, clock, "i0", INTERACTIVE, length=12)  # another bucket, and younger
    assert b.waiting_in(INTERACTIVE) == 1 and b.waiting_in(BATCH) == 3
    assert b.best_rank() == INTERACTIVE
    first = b.next_batch()
    assert [it.key for it in first.items] == ["i0"]
    second = b.next_batch()
    assert [it.key for it in second.items] == ["b0", "b1", "b2"]
    assert b.best_rank() is None


def test_batch_lane_waiting_past_promote_after_s_ranks_with_interactive():
    b, clock = batcher(promote_after_s=5)
    add(b, clock, "old-batch", BATCH)
    clock.now += 4.9
    add(b, clock, "i0", INTERACTIVE)
    assert b.take(1).items[0].key == "i0"  # not yet promoted: interactive first
    add(b, clock, "i1", INTERACTIVE)
    clock.now += 0.2  # the batch request has now waited 5.1 s: promoted, and it is the oldest
    assert b.best_rank() == INTERACTIVE
    assert b.take(1).items[0].key == "old-batch"
    assert b.take(1).items[0].key == "i1"


def test_a_steady_interactive_stream_still_lets_the_batch_lane_through():
    b, clock = batcher(promote_after_s=2, max_batch_size=1)
    add(b, clock, "batch", BATCH)
    served = []
    for n in range(100):  # one interactive arrival per 100 ms, each served at once
        add(b, clock, f"i{n}", INTERACTIVE)
        served.append(b.take(1).items[0].key)
        clock.now += 0.1
        if "batch" in served:
            break
    assert "batch" in served and len(served) <= 22  # within promote_after_s of arriving


def seq(key, lane, prompt_len, allocator=None):
    """A sequence of tokens of its own (no prefix shared with another: each holds its blocks)."""
    ids = [1000 * (1 + zlib.crc32(key.encode()) % 1000) + i for i in range(prompt_len)]
    request = Request(id=key, input_ids=tuple(ids), priority=("interactive", "batch")[lane])
    s = SeqState(key, request, ids, None, frozenset(), time.time())
    if allocator is not None:
        assert allocator.allocate(key, ids) is not None
    return s


def test_victims_are_lower_lanes_youngest_first_and_only_if_that_makes_room():
    alloc = BlockAllocator(num_blocks=10, block_size=4, prefix_caching=True)
    old_batch = seq("old-batch", BATCH, 8, alloc)  # 2 blocks
    interactive = seq("interactive", INTERACTIVE, 8, alloc)  # 2 blocks
    young_batch = seq("young-batch", BATCH, 12, alloc)  # 3 blocks
    running = [old_batch, interactive, young_batch]
    assert pick_victim(running) is young_batch
    assert pick_victim(running, below=BATCH) is None
    # 3 free; a prompt needs its blocks (with its first token) and one in reserve per runner
    assert victims_for(alloc, running, seq("small", INTERACTIVE, 9), admitted_now=0) == [young_batch]
    assert victims_for(alloc, running, seq("new", INTERACTIVE, 17), admitted_now=0) == [
        young_batch,
        old_batch,
    ]
    # a batch-lane newcomer preempts nobody, and nobody is preempted when it would not suffice
    assert victims_for(alloc, running, seq("new-batch", BATCH, 9), admitted_now=0) == []
    assert victims_for(alloc, running, seq("huge", INTERACTIVE, 30), admitted_now=0) == []


def lane_seq(runner, reference, key, prompt, lane, max_new):
    request = Request(
        id=key,
        prompt=prompt,
        max_new_tokens=max_new,
        ignore_eos=True,
        priority=("interactive", "batch")[lane],
    )
    return SeqState(key, request, reference.ids(prompt), runner.tokenizer, runner.eos_token_ids, time.time())


def test_full_pool_preempts_the_batch_lane_for_interactive_and_output_still_matches(tiny_model, reference):
    small = make_runner(
        tiny_model, device=TEST_DEVICE, dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=20)
    )
    cfg = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=4, max_seq_len=64, buckets=(16,), mode="continuous"
    )
    clock = FakeClock()
    sched = NativeCore(small, cfg, clock=clock)
    batch = [
        lane_seq(small, reference, f"b{i}", p, BATCH, 24)
        for i, p in enumerate(["Hello wor", "abcdefgh", "Once upon"])
    ]
    for s in batch:
        assert sched.add(s, clock()) is None
    urgent = lane_seq(small, reference, "i0", "tokenflt", INTERACTIVE, 6)
    alloc = sched.scheduler.allocator
    for _ in range(40):  # the batch lane grows until the pool has no room left for the newcomer
        sched.step()
        clock.now += 0.01
        if not alloc.can_allocate(urgent.all_tokens, reserve_blocks=len(sched.running())):
            break
    assert len(sched.running()) == 3 and not any(s.finished for s in batch)
    assert sched.add(urgent, clock()) is None
    out = sched.step()
    started = [t.seq.key for t in out.tokens if t.index == 0]
    assert started == ["i0"], "the interactive request did not start at the next step"
    assert out.preempted and all(s.request.priority == "batch" for s in out.preempted)
    finished = {}
    for _ in range(400):
        for t in sched.step().tokens:
            if t.finished:
                finished[t.seq.key] = t.seq
        clock.now += 0.01
        if len(finished) == 4:
            break
    assert set(finished) == {"b0", "b1", "b2", "i0"}  # the preempted batch-lane requests finish too
    for s in [*batch, urgent]:
        assert s.generated == reference.greedy(s.prompt_ids, s.request.max_new_tokens, ignore_eos=True)
    sched.check_idle()


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
    from tokenfleet.producer.openai_format import Completion, CompletionBody

    body = CompletionBody(model="m", prompt="hi", **extra)
    [(_, args)] = Completion.new("completion", body).submissions(body, lane=bulk_lane)
    assert args.get("priority") == lane


def test_an_unknown_lane_name_is_refused_by_the_openai_body():
    from pydantic import ValidationError

    from tokenfleet.producer.openai_format import CompletionBody

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
