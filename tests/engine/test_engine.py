"""The paged engine and scheduler in-process: greedy output equals ``model.generate`` token for
token in every mode, with mixed lengths, staggered arrivals and forced preemption."""

import os
import time

import pytest
import torch
from conftest import TEST_DEVICE, Reference, make_runner, missing

from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.core import NativeCore
from tokenfleet.engines.native.shapes import prefill_padded_size
from tokenfleet.kvcache.allocator import BlockAllocator
from tokenfleet.protocol import Request

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "a",
    "zzz 12345 éé 世界",
    "Redis streams carry prompts to workers",
    "x" * 30,
    "Once upon a time",
    "tokenfleet!",
]


def seq_for(runner, reference, i, prompt, max_new, **kw):
    req = Request(id=f"r{i}", prompt=prompt, max_new_tokens=max_new, **kw)
    return SeqState(
        key=f"r{i}",
        request=req,
        prompt_ids=reference.ids(prompt),
        tokenizer=runner.tokenizer,
        eos_ids=runner.eos_token_ids,
        enqueued_wall=time.time(),
    )


def drain(sched, arrivals, max_steps=5000, events=None):
    """Run steps; ``arrivals`` maps step number -> sequences that arrive just before it;
    ``events``: a list that collects every step's forward passes."""
    done, step, clock = [], 0, 0.0
    pending = sum(len(v) for v in arrivals.values())
    while len(done) < pending and step < max_steps:
        for seq in arrivals.get(step, []):
            assert sched.add(seq, clock) is None
        output = sched.step()
        if events is not None:
            events.extend(output.batches)
        for out in output.tokens:
            if out.finished:
                done.append(out.seq)
        step += 1
        clock += 1.0  # every step is "1 s": max_wait_ms is always exceeded once a step passes
    assert len(done) == pending, f"only {len(done)} of {pending} finished in {step} steps"
    return done


@pytest.fixture(scope="module")
def own_runner(tiny_model):
    """A runner of this module's own, for the tests that switch its attention routes, padding and
    graphs (the session's ``runner`` is never changed by a test)."""
    return make_runner(
        tiny_model, device=TEST_DEVICE, dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=2048)
    )


@pytest.mark.parametrize("mode", ["static", "dynamic", "continuous"])
@pytest.mark.parametrize("mix_buckets", [False, True])
def test_greedy_equals_generate_with_staggered_mixed_arrivals(runner, reference, mode, mix_buckets):
    # static only ever dispatches full batches: one bucket and an even count keep none stranded
    static = mode == "static"
    cfg = DynamicBatchingConfig(
        max_wait_ms=0,
        max_batch_size=2 if static else 4,
        max_seq_len=128,
        buckets=(64,) if static else (8, 16, 64),
        mix_buckets=mix_buckets,
        mode=mode,
    )
    sched = NativeCore(runner, cfg, clock=lambda: 1e9)
    seqs = [seq_for(runner, reference, i, p, max_new=6 + 3 * i) for i, p in enumerate(PROMPTS)]
    arrivals = {0: seqs[:3], 2: seqs[3:5], 5: seqs[5:7], 9: seqs[7:]}
    finished = drain(sched, arrivals)
    for seq in finished:
        expected = reference.greedy(seq.prompt_ids, seq.request.max_new_tokens)
        assert seq.generated == expected, seq.request.id
    sched.check_idle()
    assert sched.scheduler.allocator.num_used_blocks == 0


def test_continuous_mode_lets_requests_join_a_running_batch(runner, reference):
    cfg = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=8, max_seq_len=128, buckets=(64,), mode="continuous"
    )
    events = []
    sched = NativeCore(runner, cfg, clock=lambda: 1e9)
    first = seq_for(runner, reference, 0, PROMPTS[1], max_new=20)
    late = seq_for(runner, reference, 1, PROMPTS[0], max_new=5)
    drain(sched, {0: [first], 3: [late]}, events=events)
    decode_sizes = [ev.size for ev in events if ev.kind == "decode"]
    assert 2 in decode_sizes, "the late request never decoded beside the running one"
    assert first.generated == reference.greedy(first.prompt_ids, 20)
    assert late.generated == reference.greedy(late.prompt_ids, 5)


def test_small_pool_forces_preemption_and_still_matches(tiny_model, reference):
    # 12 blocks of 4 tokens: four sequences of ~10 prompt + 24 new tokens cannot all stay resident
    small = make_runner(
        tiny_model, device=TEST_DEVICE, dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=12)
    )
    cfg = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=4, max_seq_len=64, buckets=(16,), mode="continuous"
    )
    sched = NativeCore(small, cfg, clock=lambda: 1e9)
    seqs = [
        seq_for(small, reference, i, p, max_new=24, ignore_eos=True)
        for i, p in enumerate(["Hello wor", "abcdefgh", "Once upon", "tokenflt"])
    ]
    finished = drain(sched, {0: seqs})
    assert sched.scheduler.preemptions > 0
    for seq in finished:
        assert seq.generated == reference.greedy(seq.prompt_ids, 24, ignore_eos=True)
        assert len(seq.generated) == 24  # no duplicate or lost tokens across recompute
    sched.check_idle()
    assert sched.scheduler.allocator.num_used_blocks == 0


def test_request_larger_than_the_pool_is_rejected(tiny_model, reference):
    small = make_runner(
        tiny_model, device=TEST_DEVICE, dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=3)
    )
    sched = NativeCore(small, DynamicBatchingConfig(max_seq_len=64, buckets=(16,)))
    rejection = sched.add(seq_for(small, reference, 0, "Hello", max_new=20), 0.0)
    assert rejection is not None and rejection.code == "cache_too_small"


def test_stop_strings_cut_text_and_are_never_streamed(runner, reference):
    ids = reference.ids("Hello")
    full = reference.greedy(ids, 12)
    text = runner.tokenizer.decode(full, skip_special_tokens=True)
    stop = text[3:5]
    assert stop and stop in text
    cfg = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=2, max_seq_len=64, buckets=(16,), mode="dynamic"
    )
    sched = NativeCore(runner, cfg, clock=lambda: 1e9)
    seq = seq_for(runner, reference, 0, "Hello", max_new=12, stop=(stop,))
    sched.add(seq, 0.0)
    streamed = []
    while not seq.finished:
        streamed += [o.text for o in sched.step().tokens]
    assert seq.finish_reason == "stop"
    assert "".join(streamed) == text[: text.index(stop)]


def test_seeded_sampling_is_reproducible(runner, reference):
    cfg = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=2, max_seq_len=64, buckets=(16,), mode="dynamic"
    )
    outs = []
    for _ in range(2):
        sched = NativeCore(runner, cfg, clock=lambda: 1e9)
        seq = seq_for(runner, reference, 0, "Hello", max_new=10, temperature=1.0, top_p=0.9, top_k=50, seed=7)
        drain(sched, {0: [seq]})
        outs.append(seq.generated)
    assert outs[0] == outs[1]
    assert outs[0] != reference.greedy(reference.ids("Hello"), 10)


def test_the_paged_pool_holds_less_than_a_contiguous_cache(runner, reference):
    cfg = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=4, max_seq_len=256, buckets=(64,), mode="dynamic"
    )
    sched = NativeCore(runner, cfg, clock=lambda: 1e9)
    for i, p in enumerate(PROMPTS[:4]):
        sched.add(seq_for(runner, reference, i, p, max_new=8), 0.0)
    sched.step()  # prefill
    stored = sum(len(reference.ids(p)) for p in PROMPTS[:4])
    assert sched.scheduler.allocator.num_tokens_stored == stored
    cap = sched.capacity()
    assert cap.kv_blocks_used * cap.block_size >= stored
    assert cap.kv_bytes_used < cap.contiguous_bytes(4, 256)
    sched.abort({s.key for s in sched.held()})
    assert sched.scheduler.allocator.num_used_blocks == 0


def _greedy_batch(runner, reference, prompts, max_new):
    cfg = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=8, max_seq_len=128, buckets=(64,), mode="continuous"
    )
    sched = NativeCore(runner, cfg, clock=lambda: 1e9)
    seqs = [seq_for(runner, reference, i, p, max_new=max_new, ignore_eos=True) for i, p in enumerate(prompts)]
    got = {s.key: s.generated for s in drain(sched, {0: seqs[:5], 3: seqs[5:]})}
    sched.check_idle()
    assert sched.scheduler.allocator.num_used_blocks == 0
    return got


@pytest.mark.parametrize("path", ["kernel", "gather", "padded-batch", "triton", "cuda-graphs"])
def test_every_attention_path_equals_generate(own_runner, reference, path):
    """The CPU kernels (decode reading the pool in place, prefill on the packed prompts), the
    gather/padding + SDPA fallback, batches padded to the compiled buckets (scratch-block rows),
    the Triton decode kernel (in Triton's interpreter on the CPU) and decode replayed from CUDA
    graphs all give generate's tokens."""
    from tokenfleet.engines.native.attention import triton_paged
    from tokenfleet.engines.native.cuda_graphs import DecodeGraphs
    from tokenfleet.engines.native.kernels.loader import load_kernels

    runner = own_runner  # this module's own: the test switches its attention routes and graphs
    on_cpu = runner.device.type == "cpu"
    if path == "kernel" and not on_cpu:
        pytest.skip("the C++ kernels are for CPU tensors")
    if path == "kernel" and load_kernels() is None:
        missing("the CPU kernels", "the CPU kernels did not build here")
    if path == "triton" and not triton_paged.available():
        pytest.skip("no Triton here")
    if path == "cuda-graphs" and not (runner.device.type == "cuda" and triton_paged.available()):
        pytest.skip("CUDA graphs need a GPU (and Triton)")
    saved = runner.use_kernel, runner.use_prefill_kernel, runner.pad_decode_batches, runner.use_triton
    runner.use_kernel = runner.use_prefill_kernel = (
        path in ("kernel", "padded-batch") and on_cpu and load_kernels() is not None
    )
    runner.pad_decode_batches = path == "padded-batch"
    runner.use_triton = path in ("triton", "cuda-graphs")
    if path == "triton" and on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 before Triton is imported")
    graphs = runner.graphs
    if path == "cuda-graphs":
        pad = runner.pad_token_id
        runner.graphs = DecodeGraphs(runner.store, runner.upload, [8], 8, runner.scratch_block, pad)
        runner.warm_up()
        assert runner.graphs.captured, "the tiny model's decode could not be captured"
    # Triton's interpreter runs each kernel instance in numpy: a shorter run on the CPU
    prompts, max_new = (PROMPTS[:4], 5) if path == "triton" and on_cpu else (PROMPTS, 14)
    try:
        got = _greedy_batch(runner, reference, prompts, max_new=max_new)
        if path == "cuda-graphs":
            assert runner.graphs.replays > 0
    finally:
        runner.use_kernel, runner.use_prefill_kernel, runner.pad_decode_batches, runner.use_triton = saved
        runner.graphs = graphs
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference.greedy(reference.ids(prompt), max_new, ignore_eos=True), prompt


def test_prefill_sizes_are_few_and_their_padding_small():
    sizes = {prefill_padded_size(n) for n in range(1, 8193)}
    assert len(sizes) <= 100  # oneDNN builds each once and keeps it
    for n in range(1, 8193):
        assert 0 <= prefill_padded_size(n) - n < max(16, n / 16), n


def test_prefill_padding_leaves_the_prompts_logits_and_cache_alone(own_runner, reference):
    """The padding prompt writes only to the scratch block: each real prompt's logits and K/V
    are those of the same prefill unpadded."""
    runner = own_runner  # this module's own: the test switches its prefill padding
    prompts = [reference.ids(p) for p in PROMPTS[:3]]
    assert prefill_padded_size(sum(map(len, prompts))) > sum(map(len, prompts))  # padding does happen
    alloc = BlockAllocator(runner.num_blocks, runner.block_size, prefix_caching=False)  # all computed here
    keys = [("pad", i) for i in range(len(prompts))]
    results = []
    saved = runner.pad_prefill
    try:
        for pad in (True, False):
            runner.pad_prefill = pad
            tables = [alloc.allocate(key, ids).table for key, ids in zip(keys, prompts)]
            try:
                logits = runner.prefill(tables, prompts).logits
                slots = [alloc.slot(k, i) for k, ids in zip(keys, prompts) for i in range(len(ids))]
                last_layer = (runner.store.k[-1], runner.store.v[-1])  # after every layer's attention
                kv = torch.stack([t.flatten(0, 1)[torch.tensor(slots, device=t.device)] for t in last_layer])
                results.append((logits, kv))
            finally:
                for key in keys:
                    alloc.free(key)
    finally:
        runner.pad_prefill = saved
    (padded_logits, padded_kv), (logits, kv) = results
    torch.testing.assert_close(padded_logits, logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(padded_kv, kv, rtol=1e-4, atol=1e-4)


def test_packed_prefill_of_mixed_lengths_runs_in_one_forward(runner, reference):
    """Prompts of different lengths go through one forward laid end to end: the forward computes
    the prompt tokens and at most the padding to the next prefill size, and each prompt's next
    token is generate's."""
    prompts = [reference.ids(p) for p in PROMPTS]
    alloc = BlockAllocator(runner.num_blocks, runner.block_size, prefix_caching=False)  # all computed here
    tables = [alloc.allocate(("packed", i), ids).table for i, ids in enumerate(prompts)]
    result = runner.prefill(tables, prompts)
    assert result.forwards == 1
    real = sum(len(p) for p in prompts)
    assert result.computed_tokens == (prefill_padded_size(real) if runner.pad_prefill else real)
    firsts = result.logits.argmax(-1).tolist()
    assert firsts == [reference.greedy(p, 1, ignore_eos=True)[0] for p in prompts]


@pytest.mark.filterwarnings("ignore::UserWarning")  # inductor's own (TypedStorage) deprecation notes
@pytest.mark.timeout(300)  # two compiles: a minute or more each on a busy 2-core machine
def test_compiled_decode_equals_generate_for_two_models_in_one_process(tiny_model, reference, tmp_path):
    """torch.compile'd decode (frozen weights, autotuned matmuls, padded batches) keeps greedy
    equivalence (one bucket, max_batch_size 8, keeps each compile short). Compiled graphs freeze
    the weights in as constants and skip most guards on the model's modules (keep_guards): a
    second model of the same class, compiled in the same process, must still get graphs of its
    own, and the first engine keep its. One test, so the suite pays for two compiles, not three."""
    from tokenfleet.models import init_model

    other_dir = str(init_model(tmp_path / "other", "tiny", seed=1))
    other_reference = Reference(other_dir)
    first, second = (
        make_runner(
            d,
            device=TEST_DEVICE,
            dtype="float32",
            compile=True,
            kv=KVCacheConfig(block_size=4, num_blocks=512),
            batching=DynamicBatchingConfig(max_batch_size=8),
        )
        for d in (tiny_model, other_dir)
    )
    assert first.decode_buckets == [8]
    assert first.warm_up() > 0
    got = _greedy_batch(first, reference, PROMPTS, max_new=10)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"] == reference.greedy(reference.ids(prompt), 10, ignore_eos=True), prompt
    prompts = PROMPTS[:3]
    for eng, ref in ((second, other_reference), (first, reference)):
        got = _greedy_batch(eng, ref, prompts, max_new=6)
        for i, prompt in enumerate(prompts):
            assert got[f"r{i}"] == ref.greedy(ref.ids(prompt), 6, ignore_eos=True), prompt
    assert other_reference.greedy(other_reference.ids(prompts[0]), 6, ignore_eos=True) != reference.greedy(
        reference.ids(prompts[0]), 6, ignore_eos=True
    ), "the two random models must differ for this test to mean anything"


def test_prefill_attention_groups_prompts_of_similar_length():
    """Packed prefill pads prompts only to the longest of their group: every row in exactly one
    group, none shorter than GROUP_MIN_FRACTION of its group's longest."""
    from tokenfleet.engines.native.attention.torch_route import GROUP_MIN_FRACTION, length_groups

    lengths = [128, 16, 100, 97, 20, 256, 12, 128, 90]
    groups = length_groups(lengths)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[r] for r in group)
        assert all(lengths[r] >= GROUP_MIN_FRACTION * longest for r in group)
    assert [sorted(g) for g in groups] == [[5], [0, 2, 3, 7], [8], [1, 4], [6]]


def test_continuous_joins_never_stall_running_sequences_two_prefills_in_a_row(runner, reference):
    # a request arriving before every step: without a decode between joins, the running ones
    # would wait out prefill after prefill
    cfg = DynamicBatchingConfig(
        max_wait_ms=0, max_batch_size=8, max_seq_len=128, buckets=(64,), mode="continuous"
    )
    events = []
    sched = NativeCore(runner, cfg, clock=lambda: 1e9)
    seqs = [seq_for(runner, reference, i, PROMPTS[i % len(PROMPTS)], max_new=12) for i in range(6)]
    finished = drain(sched, {step: [seq] for step, seq in enumerate(seqs)}, events=events)
    kinds = [ev.kind for ev in events]
    assert "prefill" not in {a for a, b in zip(kinds, kinds[1:]) if a == b}, kinds
    # those that arrived during a decode step join together at the next
    assert sum(ev.size for ev in events if ev.kind == "prefill") == len(seqs)
    assert kinds.count("prefill") < len(seqs)
    for seq in finished:
        assert seq.generated == reference.greedy(seq.prompt_ids, 12), seq.request.id


def test_continuous_starts_a_batch_over_max_prefill_tokens_in_parts_a_decode_between(runner, reference):
    # six prompts at once on an idle worker, a budget that holds about two of them: they start in
    # parts (earlier first tokens for the first part), each part within the budget unless a
    # prompt alone exceeds it, a decode step between parts, every token still generate's
    budget = 24
    cfg = DynamicBatchingConfig(
        max_wait_ms=0,
        max_batch_size=8,
        max_seq_len=128,
        buckets=(64,),
        mode="continuous",
        max_prefill_tokens=budget,
    )
    events = []
    sched = NativeCore(runner, cfg, clock=lambda: 1e9)
    seqs = [seq_for(runner, reference, i, PROMPTS[i], max_new=6) for i in range(6)]
    finished = drain(sched, {0: seqs}, events=events)
    prefills = [ev for ev in events if ev.kind == "prefill"]
    assert len(prefills) >= 3, [(ev.size, ev.computed_tokens) for ev in prefills]
    assert all(ev.prompt_tokens <= budget or ev.size == 1 for ev in prefills)
    assert sum(ev.size for ev in prefills) == len(seqs)
    kinds = [ev.kind for ev in events]
    assert "prefill" not in {a for a, b in zip(kinds, kinds[1:]) if a == b}, kinds
    for seq in finished:
        assert seq.generated == reference.greedy(seq.prompt_ids, 6), seq.request.id


def test_dynamic_mode_starts_its_batch_whole_whatever_max_prefill_tokens(runner, reference):
    cfg = DynamicBatchingConfig(
        max_wait_ms=0,
        max_batch_size=8,
        max_seq_len=128,
        buckets=(64,),
        mode="dynamic",
        max_prefill_tokens=8,
    )
    events = []
    sched = NativeCore(runner, cfg, clock=lambda: 1e9)
    drain(sched, {0: [seq_for(runner, reference, i, PROMPTS[i], max_new=3) for i in range(4)]}, events=events)
    assert [ev.size for ev in events if ev.kind == "prefill"] == [4]
