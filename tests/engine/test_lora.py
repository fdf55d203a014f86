"""LoRA adapters in the native engine, against PEFT itself in float32: rows of four adapters of
different ranks and targets and rows of the base model, in one batch, in every batching mode and
on both forwards (the lean one, whose q/k/v and gate/up are fused, and transformers'), greedy
equal to ``PeftModel.generate`` token for token; a prefix cached under one adapter is never used
for another or for the base; more adapters than slots are all served right; an adapter that
cannot load fails only its own requests, with ``adapter_unavailable``."""

from __future__ import annotations

import time

import pytest
from conftest import make_runner
from lora_adapters import ALL, PeftReference, make_adapter

from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig
from tokenfleet.core.offline import run_offline
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.core import NativeCore
from tokenfleet.protocol import ErrorCode, Request

pytestmark = pytest.mark.integration

NEW = 10
PROMPTS = ["Hello there, how are you?", "The quick brown fox", "abc def", "Once upon a time", "zz", "lorem"]
KINDS = {
    "r4": (4, ["gate_proj", "k_proj"]),
    "r8": (8, ["q_proj", "v_proj"]),
    "r16": (16, ALL),
    "r64": (64, ["down_proj", "o_proj"]),
}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny_model, root / name, r, t, seed=i)
        for i, (name, (r, t)) in enumerate(KINDS.items())
    }


@pytest.fixture(scope="module")
def peft(tiny_model) -> PeftReference:
    return PeftReference(tiny_model)


def seq_of(
    runner, key: str, ids: list[int], adapter: str | None, path: str | None, new: int = NEW
) -> SeqState:
    request = Request(id=key, input_ids=tuple(ids), max_new_tokens=new, ignore_eos=True, adapter=adapter)
    return SeqState(
        key, request, list(ids), runner.tokenizer, runner.eos_token_ids, time.time(), adapter_path=path
    )


def serve(runner, mode: str, rows: list[tuple[list[int], str | None, str | None]], size: int = 6):
    """Each row (prompt ids, adapter, its directory) through a core in ``mode``; the sequences."""
    batching = DynamicBatchingConfig(
        mode=mode, max_wait_ms=0, max_batch_size=size, max_seq_len=256, buckets=(64,)
    )
    core = NativeCore(runner, batching, clock=lambda: 1e9)
    seqs = [seq_of(runner, f"{mode}-{i}", ids, a, p) for i, (ids, a, p) in enumerate(rows)]
    run = run_offline(core, [(0.0 if mode != "continuous" else 0.005 * i, s) for i, s in enumerate(seqs)])
    return core, seqs, run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "transformers-forward"])
def test_mixed_adapters_and_base_rows_equal_peft_in_every_mode(tiny_model, adapters, peft, reference, lean):
    runner = make_runner(
        tiny_model,
        device="cpu",
        dtype="float32",
        paged_kernel=lean,
        kv=KVCacheConfig(block_size=4, num_blocks=1024),
    )
    assert (runner.lean is not None) == lean
    names = [None, "r8", "r16", "r64", "r4", "r8"]
    rows = [(reference.ids(p), a, adapters.get(a or "")) for p, a in zip(PROMPTS, names)]
    for mode in ("static", "dynamic", "continuous"):
        core, seqs, run = serve(runner, mode, rows, size=6 if mode != "static" else 3)
        assert not run.failed, run.failed
        for seq, (ids, name, path) in zip(seqs, rows):
            assert seq.generated == peft.greedy(path, ids, NEW), f"{name} in {mode} mode"
        assert set(core.adapters.resident()) == {"r4", "r8", "r16", "r64"}


def test_a_prefix_cached_under_one_adapter_serves_it_alone(runner_with_cache, adapters, peft, reference):
    """The same 40-token prompt under r16, then r8, then the base, then r16 again, one after the
    other through one core: only the last finds cached blocks, and every answer is its own
    model's."""
    ids = reference.ids("a shared system prompt that is long enough to fill blocks " * 2)[:40]
    batching = DynamicBatchingConfig(
        mode="dynamic", max_wait_ms=0, max_batch_size=1, max_seq_len=256, buckets=(64,)
    )
    core = NativeCore(runner_with_cache, batching, clock=lambda: 1e9)
    done = []
    for i, name in enumerate(("r16", "r8", None, "r16")):
        seq = seq_of(runner_with_cache, f"turn-{i}", ids, name, adapters.get(name or ""))
        assert not run_offline(core, [(0.0, seq)]).failed
        assert seq.generated == peft.greedy(adapters.get(name or ""), ids, NEW), name
        done.append(seq.cached_tokens)
    assert done[:3] == [0, 0, 0] and done[3] > 0  # only the same adapter again hits


@pytest.fixture(scope="module")
def runner_with_cache(tiny_model):
    return make_runner(
        tiny_model, device="cpu", dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=1024)
    )


@pytest.mark.timeout(600)
def test_more_adapters_than_slots_are_all_served_right(tiny_model, peft, reference, tmp_path):
    """12 adapters through 4 slots, requests interleaved: loads wait for a slot whose adapter no
    held sequence uses, the least recently used is evicted, every answer equals PEFT's."""
    twelve = {
        f"a{i}": make_adapter(
            tiny_model, tmp_path / f"a{i}", 4 + 4 * (i % 3), ["q_proj", "down_proj"], seed=50 + i
        )
        for i in range(12)
    }
    runner = make_runner(
        tiny_model,
        device="cpu",
        dtype="float32",
        max_loras=4,
        kv=KVCacheConfig(block_size=4, num_blocks=1024),
    )
    rows = [(reference.ids(PROMPTS[i % len(PROMPTS)]), f"a{i % 12}", twelve[f"a{i % 12}"]) for i in range(24)]
    core, seqs, run = serve(runner, "continuous", rows, size=6)
    assert not run.failed, run.failed
    for seq, (ids, name, path) in zip(seqs, rows):
        assert seq.generated == peft.greedy(path, ids, NEW), name
    assert len(core.adapters.resident()) == 4


def test_an_adapter_that_cannot_load_fails_only_its_requests(
    tiny_model, adapters, peft, reference, tmp_path, qwen_like
):
    """Missing, corrupt, made for another model (wrong shapes) and over --max-lora-rank: each of
    those rows ends with adapter_unavailable saying why; a good adapter's and a base row's rows in
    the same batch are served, equal to PEFT's."""
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    other = make_adapter(qwen_like, tmp_path / "other", 8, ["q_proj"], seed=9)
    runner = make_runner(
        tiny_model,
        device="cpu",
        dtype="float32",
        max_lora_rank=32,
        kv=KVCacheConfig(block_size=4, num_blocks=512),
    )
    ids = reference.ids("fails alone")
    broken = {
        "missing": str(tmp_path / "nothing-here"),
        "corrupt": str(corrupt),
        "other-model": other,
        "too-high": adapters["r64"],
    }
    rows = [(ids, name, path) for name, path in broken.items()] + [
        (ids, "r8", adapters["r8"]),
        (ids, None, None),
    ]
    _, seqs, run = serve(runner, "continuous", rows, size=6)
    failed = {seq.request.adapter: why for seq, why in run.failed}
    assert set(failed) == set(broken), failed
    assert all(why.startswith(ErrorCode.ADAPTER_UNAVAILABLE) for why in failed.values())
    assert "rank 64" in failed["too-high"] and "do not fit" in failed["other-model"]
    assert seqs[-2].generated == peft.greedy(adapters["r8"], ids, NEW)
    assert seqs[-1].generated == peft.greedy(None, ids, NEW)


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory) -> str:
    """A model of another shape (the families' qwen2), for an adapter that does not fit the tiny one."""
    from families import build_family

    return build_family("qwen2", tmp_path_factory.mktemp("other") / "qwen2")


def slotted_core(tiny_model: str, slots: int) -> NativeCore:
    """A continuous-batching core on a runner of its own with ``slots`` adapter slots."""
    kv = KVCacheConfig(block_size=4, num_blocks=1024)
    runner = make_runner(tiny_model, device="cpu", dtype="float32", max_loras=slots, kv=kv)
    batching = DynamicBatchingConfig(
        mode="continuous", max_wait_ms=0, max_batch_size=8, max_seq_len=256, buckets=(64,)
    )
    return NativeCore(runner, batching, clock=lambda: 1e9)


def step_loaded(core: NativeCore) -> None:
    """One step as the worker takes it (parked sequences opened first), or a moment's wait while
    an adapter loads on its thread; every adapter in these tests loads."""
    assert not core.open_parked()
    if not core.step().tokens:
        time.sleep(0.001)


@pytest.mark.timeout(300)
def test_steady_traffic_to_resident_adapters_cannot_starve_a_cold_one(tiny_model, peft, reference, tmp_path):
    """Two slots, each held by an adapter that always has requests in flight: a third adapter's
    request still runs (the least recently used adapter drains: its new requests wait until it
    has been swapped out and back), and every answer equals PEFT's."""
    paths = {
        f"s{i}": make_adapter(tiny_model, tmp_path / f"s{i}", 8, ["q_proj"], seed=70 + i) for i in range(3)
    }
    core = slotted_core(tiny_model, 2)
    runner = core.runner
    ids = reference.ids("steady traffic")
    seqs: list[SeqState] = []

    def add(name: str) -> SeqState:
        seqs.append(seq_of(runner, f"{name}-{len(seqs)}", ids, name, paths[name]))
        assert core.add(seqs[-1], time.monotonic()) is None
        return seqs[-1]

    cold = None
    for _ in range(5000):
        for name in ("s0", "s1"):  # steady: each always has requests held
            if sum(s.request.adapter == name for s in core.held()) < 3:
                add(name)
        if cold is None and set(core.adapters.resident()) == {"s0", "s1"}:
            cold = add("s2")
        step_loaded(core)
        if cold is not None and cold.finished:
            break
    assert cold is not None and cold.finished, "the cold adapter never got a slot"
    for _ in range(5000):
        if not core.held():
            break
        step_loaded(core)
    assert all(s.finished for s in seqs)
    expected = {name: peft.greedy(path, ids, NEW) for name, path in paths.items()}
    for seq in seqs:
        assert seq.generated == expected[seq.request.adapter], seq.key


def test_a_name_added_again_with_new_files_serves_the_new_weights(tiny_model, peft, reference, tmp_path):
    """An adapter removed and added again under the same name from another directory: the worker
    that held the old weights serves the new ones (it holds adapters, and caches their prefixes,
    by name and directory)."""
    old = make_adapter(tiny_model, tmp_path / "old", 8, ALL, seed=80)
    new = make_adapter(tiny_model, tmp_path / "new", 8, ALL, seed=81)
    runner = make_runner(
        tiny_model, device="cpu", dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=512)
    )
    ids = reference.ids("new weights: a prompt that fills cached blocks")
    batching = DynamicBatchingConfig(
        mode="dynamic", max_wait_ms=0, max_batch_size=1, max_seq_len=256, buckets=(64,)
    )
    core = NativeCore(runner, batching, clock=lambda: 1e9)
    first, again, second = (
        seq_of(runner, f"turn-{i}", ids, "same", p) for i, p in enumerate((old, old, new))
    )
    for seq in (first, again, second):
        assert not run_offline(core, [(0.0, seq)]).failed
    assert again.cached_tokens > 0 and second.cached_tokens == 0
    assert first.generated == again.generated == peft.greedy(old, ids, NEW)
    assert second.generated == peft.greedy(new, ids, NEW) != first.generated


@pytest.mark.timeout(300)
def test_one_slot_takes_turns_between_adapters_asked_for_at_once(tiny_model, peft, reference, tmp_path):
    """One slot, five adapters with requests all waiting at once (their loads finish while others
    run): each adapter gets its turn, none is swapped out before its requests ran, every answer
    equals PEFT's."""
    paths = {
        f"t{i}": make_adapter(tiny_model, tmp_path / f"t{i}", 8, ["v_proj"], seed=90 + i) for i in range(5)
    }
    core = slotted_core(tiny_model, 1)
    runner = core.runner
    ids = reference.ids("turns")
    # long enough that every load is done while the first adapter still runs: the next two are both
    # ready when its slot frees (the case where one was swapped out before it ever ran)
    seqs = [seq_of(runner, f"{n}-{j}", ids, n, p, new=80) for j in range(3) for n, p in paths.items()]
    for seq in seqs:
        assert core.add(seq, time.monotonic()) is None
    for _ in range(20000):
        if not core.held():
            break
        step_loaded(core)
    assert all(s.finished for s in seqs), [s.key for s in seqs if not s.finished]
    expected = {name: peft.greedy(path, ids, 80) for name, path in paths.items()}
    for seq in seqs:
        assert seq.generated == expected[seq.request.adapter], seq.key
