"""Prefix caching in the native engine: with cache hits, greedy output still equals
``model.generate`` token for token (float32) in every batching mode, with sequences sharing blocks
at once, with hits on a preempted sequence's blocks and under a pool small enough to preempt; the
shared blocks are never written; the pool's integrity check holds throughout."""

import time

import pytest
import torch
from conftest import TEST_DEVICE, make_runner

from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.core import NativeCore
from tokenfleet.protocol import Request

pytestmark = pytest.mark.integration

# a "system prompt" of 11 blocks of 4, then each request's own words
SYSTEM = list(range(40, 84))
SUFFIXES = [[5, 6, 7], [5, 6, 9, 10, 11], [200], [5, 6, 7, 8, 12, 13, 14], [7, 7, 7, 7, 7, 7], [300, 301]]


@pytest.fixture(scope="module")
def own_runner(tiny_model):
    """A runner of this module's own, for the test that switches its prefill route (the session's
    ``runner`` is never changed by a test)."""
    return make_runner(
        tiny_model, device=TEST_DEVICE, dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=2048)
    )


def seq_for(runner, key, ids, max_new):
    request = Request(id=key, input_ids=tuple(ids), max_new_tokens=max_new, ignore_eos=True)
    return SeqState(key, request, list(ids), runner.tokenizer, runner.eos_token_ids, time.time())


def drain(core, arrivals, checks=True):
    """Step until every arrival has finished (``arrivals``: step -> sequences added before it);
    the pool's integrity check after every step."""
    done, step = [], 0
    pending = sum(len(v) for v in arrivals.values())
    while len(done) < pending and step < 5000:
        for seq in arrivals.get(step, []):
            assert core.add(seq, 0.0) is None
        done += [out.seq for out in core.step().tokens if out.finished]
        if checks:
            core.scheduler.allocator.check_integrity()
        step += 1
    assert len(done) == pending, f"{len(done)} of {pending} finished"
    core.check_idle()
    return done


@pytest.mark.parametrize("mode", ["static", "dynamic", "continuous"])
def test_greedy_equals_generate_with_prefix_hits_in_every_mode(runner, reference, mode):
    """Requests sharing a long prefix arrive together (they share blocks named in that same step)
    and later (they hit blocks cached by finished ones)."""
    cfg = DynamicBatchingConfig(max_wait_ms=0, max_batch_size=4, max_seq_len=256, buckets=(64,), mode=mode)
    core = NativeCore(runner, cfg, clock=lambda: 1e9)
    seqs = [seq_for(runner, f"{mode}-{i}", SYSTEM + s, 10) for i, s in enumerate(SUFFIXES)]
    arrivals = {0: seqs[:4], 25: seqs[4:]} if mode == "static" else {0: seqs[:3], 4: seqs[3:5], 40: seqs[5:]}
    if mode == "static":  # a static batch waits for max_batch_size: make the second one whole
        seqs.append(seq_for(runner, "static-extra", SYSTEM + [9, 9], 10))
        seqs.append(seq_for(runner, "static-extra2", SYSTEM + [8], 10))
        arrivals[25] = seqs[4:]
    for seq in drain(core, arrivals):
        assert seq.generated == reference.greedy(seq.prompt_ids, 10, ignore_eos=True), seq.request.id
    hit = [s for s in seqs if s.cached_tokens]
    assert len(hit) >= len(seqs) - 1, [s.cached_tokens for s in seqs]  # all but the very first
    assert all(s.cached_tokens <= len(s.prompt_ids) - 1 for s in seqs)
    assert core.scheduler.allocator.hits == sum(s.cached_tokens for s in seqs) > 0


def test_a_second_turn_reuses_the_first_turns_blocks_generated_tokens_included(runner, reference):
    cfg = DynamicBatchingConfig(max_wait_ms=0, max_batch_size=4, max_seq_len=256, buckets=(64, 128))
    core = NativeCore(runner, cfg, clock=lambda: 1e9)
    (first,) = drain(core, {0: [seq_for(runner, "turn-1", SYSTEM + [5, 6, 7], 13)]})
    history = first.prompt_ids + first.generated
    second = seq_for(runner, "turn-2", history + [250, 251, 252], 8)
    drain(core, {0: [second]})
    # the last answer token's K/V was never computed (the sequence ended on it): its block is not full
    assert second.cached_tokens == (len(history) - 1) // runner.block_size * runner.block_size
    assert second.cached_tokens > len(first.prompt_ids)  # generated tokens' blocks were reused too
    assert second.generated == reference.greedy(second.prompt_ids, 8, ignore_eos=True)


def test_sequences_sharing_blocks_decode_side_by_side_and_never_write_them(runner, reference):
    cfg = DynamicBatchingConfig(max_wait_ms=0, max_batch_size=4, max_seq_len=256, buckets=(64,))
    core = NativeCore(runner, cfg, clock=lambda: 1e9)
    a, b = (seq_for(runner, k, SYSTEM + s, 16) for k, s in (("a", [1, 2]), ("b", [3])))
    assert core.add(a, 0.0) is None
    core.step()  # a's prefill names the system prompt's blocks
    shared = core.scheduler.allocator.block_table("a")[: len(SYSTEM) // runner.block_size]
    before = [(k[shared].clone(), v[shared].clone()) for k, v in zip(runner.store.k, runner.store.v)]
    assert core.add(b, 0.0) is None
    done, side_by_side = [], 0
    while len(done) < 2:
        done += [o.seq for o in core.step().tokens if o.finished]
        if "b" in core.scheduler.allocator and "a" in core.scheduler.allocator:
            assert (
                core.scheduler.allocator.block_table("b")[: len(shared)] == shared
            )  # the same blocks, held twice
            side_by_side += 1
    assert side_by_side > 10
    assert b.cached_tokens == len(SYSTEM)
    for (k0, v0), k, v in zip(before, runner.store.k, runner.store.v):
        assert torch.equal(k0, k[shared]) and torch.equal(v0, v[shared])
    for seq in (a, b):
        assert seq.generated == reference.greedy(seq.prompt_ids, 16, ignore_eos=True)
    core.check_idle()


def test_hits_on_preempted_sequences_blocks_in_a_pool_that_must_preempt(tiny_model, reference):
    """A pool of 40 blocks of 4 cannot hold six sequences of ~50 tokens growing by 30: the youngest
    are preempted, and when they resume their own full blocks (still cached) are hits."""
    small = make_runner(
        tiny_model, device="cpu", dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=40)
    )
    cfg = DynamicBatchingConfig(max_wait_ms=0, max_batch_size=6, max_seq_len=256, buckets=(64,))
    core = NativeCore(small, cfg, clock=lambda: 1e9)
    seqs = [seq_for(small, f"p{i}", SYSTEM[:36] + s, 30) for i, s in enumerate(SUFFIXES)]
    for seq in drain(core, {0: seqs}):
        assert seq.generated == reference.greedy(seq.prompt_ids, 30, ignore_eos=True), seq.request.id
    assert core.scheduler.preemptions > 0, "the pool was never short: the test proves nothing"
    preempted = [s for s in seqs if s.preemptions]
    assert core.scheduler.allocator.hits > sum(s.cached_tokens for s in seqs), "no resume hit its own blocks"
    assert preempted


def test_without_prefix_caching_every_token_is_computed(tiny_model, reference):
    kv = KVCacheConfig(block_size=4, num_blocks=200, prefix_caching=False)
    runner = make_runner(tiny_model, device="cpu", dtype="float32", kv=kv)
    cfg = DynamicBatchingConfig(max_wait_ms=0, max_batch_size=4, max_seq_len=256, buckets=(64,))
    core = NativeCore(runner, cfg, clock=lambda: 1e9)
    seqs = [seq_for(runner, f"n{i}", SYSTEM + s, 6) for i, s in enumerate(SUFFIXES[:3])]
    done = drain(core, {0: seqs[:1], 3: seqs[1:]})
    assert all(s.cached_tokens == 0 for s in done) and core.scheduler.allocator.hits == 0
    for seq in done:
        assert seq.generated == reference.greedy(seq.prompt_ids, 6, ignore_eos=True)


@pytest.mark.parametrize("route", ["kernel", "sdpa"])
def test_a_cached_prefix_gives_the_logits_of_computing_it_again(own_runner, route):
    """The prefill of a prompt's uncached tail, attending to its cached blocks in place (the C++
    kernel, or SDPA prompt by prompt), gives the logits and K/V of prefilling the whole prompt."""
    from tokenfleet.kvcache.allocator import BlockAllocator

    runner = own_runner  # this module's own: the test switches its prefill route
    saved = runner.use_kernel, runner.use_prefill_kernel
    runner.use_kernel = runner.use_prefill_kernel = route == "kernel"
    try:
        alloc = BlockAllocator(runner.num_blocks, runner.block_size, prefix_caching=True)
        prompts = [SYSTEM + s for s in SUFFIXES[:3]]
        whole = BlockAllocator(runner.num_blocks, runner.block_size, prefix_caching=False)
        tables = [whole.allocate(("whole", i), p).table for i, p in enumerate(prompts)]
        want = runner.prefill(tables, prompts).logits
        first = alloc.allocate("first", prompts[0])
        runner.prefill([first.table], [prompts[0]])
        rest = [alloc.allocate(f"r{i}", p) for i, p in enumerate(prompts[1:])]
        assert all(r.cached_tokens == len(SYSTEM) for r in rest)
        got = runner.prefill(
            [r.table for r in rest],
            [p[r.cached_tokens :] for r, p in zip(rest, prompts[1:])],
            [r.cached_tokens for r in rest],
        )
        torch.testing.assert_close(got.logits, want[1:], rtol=1e-4, atol=1e-4)
        assert got.computed_tokens < sum(len(p) for p in prompts[1:])
    finally:
        runner.use_kernel, runner.use_prefill_kernel = saved
