"""Every architecture is served exactly or refused with its reason, never served wrong: tiny
random models of many families (sliding windows shorter than the prompts, softcaps, partial
rotary, a head's own scaling) greedy-decode as ``model.generate`` does, in float32, in every
batching mode; a model whose forward the engine does not compute (ALiBi) is refused at load,
naming the first layer that parts, and so is a runner whose attention a test breaks."""

from __future__ import annotations

import time

import pytest
from conftest import Reference, make_runner
from families import FAMILIES, REFUSED, build_family

from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig
from tokenfleet.core.offline import run_offline
from tokenfleet.core.sequence import SeqState
from tokenfleet.engines.native.core import NativeCore
from tokenfleet.engines.native.probe import ModelMismatch
from tokenfleet.protocol import Request

pytestmark = pytest.mark.integration

PROMPTS = [
    "Hello there, how are you doing today my friend?",
    "abc",
    "The quick brown fox jumps over the lazy dog, again and again",
    "A window shorter than this prompt must still be honoured",
]
NEW_TOKENS = 16
KV = KVCacheConfig(block_size=4, num_blocks=256)


def served(runner, mode: str, reference: Reference) -> list[tuple[list[int], list[int]]]:
    """Each prompt's greedy tokens from a core in ``mode`` beside ``generate``'s."""
    size = len(PROMPTS) if mode != "static" else 2  # static: two full batches
    batching = DynamicBatchingConfig(
        mode=mode, max_wait_ms=0, max_batch_size=size, max_seq_len=256, buckets=(64,)
    )
    core = NativeCore(runner, batching, clock=lambda: 1e9)
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        ids = reference.ids(prompt)
        request = Request(id=f"{mode}-{i}", input_ids=tuple(ids), max_new_tokens=NEW_TOKENS, ignore_eos=True)
        seqs.append(SeqState(request.id, request, ids, runner.tokenizer, runner.eos_token_ids, time.time()))
    arrivals = [(0.0 if mode != "continuous" else 0.01 * i, seq) for i, seq in enumerate(seqs)]
    assert not run_offline(core, arrivals).failed
    return [(s.generated, reference.greedy(s.prompt_ids, NEW_TOKENS, ignore_eos=True)) for s in seqs]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_greedy_decodes_as_generate_in_every_mode(family, tmp_path):
    model_dir = build_family(family, tmp_path / family)
    runner = make_runner(model_dir, device="cpu", dtype="float32", kv=KV)
    reference = Reference(model_dir)
    for mode in ("static", "dynamic", "continuous"):
        for ours, theirs in served(runner, mode, reference):
            assert ours == theirs, f"{family} in {mode} mode"


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_a_family_the_engine_cannot_compute_is_refused_naming_the_layer(family, tmp_path):
    model_dir = build_family(family, tmp_path / family)
    with pytest.raises(ModelMismatch, match="parts from transformers'.*first at layer 0"):
        make_runner(model_dir, device="cpu", dtype="float32", kv=KV)


def test_a_runner_whose_attention_is_broken_is_refused_at_load(tiny_model, monkeypatch):
    """The guard for families nobody tested: an attention a hair off (one layer's output scaled
    by 1%) on the torch route is found by the load-time probe, and the layer named."""
    from tokenfleet.engines.native.attention import torch_route

    attend = torch_route.Scores.attend
    monkeypatch.setattr(torch_route.Scores, "attend", lambda self, *a: attend(self, *a) * 1.01)
    with pytest.raises(ModelMismatch, match="first at layer 0"):
        make_runner(tiny_model, device="cpu", dtype="float32", kv=KV, paged_kernel=False)


def test_a_window_within_the_context_keeps_the_model_off_the_kernels(tmp_path, caplog, kernels):
    model_dir = build_family("mistral-window", tmp_path / "w")
    with caplog.at_level("INFO", logger="tokenfleet.engines.native.runner"):
        runner = make_runner(model_dir, device="cpu", dtype="float32", kv=KV)
    assert not runner.use_kernel and runner.lean is None
    assert "a sliding window of 8 tokens" in caplog.text
    # a window as long as the context changes nothing: the kernels and the lean forward stay
    wide = build_family("mistral", tmp_path / "m")
    assert make_runner(wide, device="cpu", dtype="float32", kv=KV).lean is not None
