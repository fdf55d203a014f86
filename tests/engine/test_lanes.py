"""Priority lanes in the engine core: preemption victims are lower-lane sequences, youngest
first, and only where that makes room; a full KV pool gives way to an interactive request by
preempting the batch lane, and every output still equals ``model.generate``."""

import time
import zlib

from conftest import TEST_DEVICE, make_runner

from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig
from tokenfleet.core.lanes import pick_victim, victims_for
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.core import NativeCore
from tokenfleet.kvcache.allocator import BlockAllocator
from tokenfleet.protocol import Request

INTERACTIVE, BATCH = 0, 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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
