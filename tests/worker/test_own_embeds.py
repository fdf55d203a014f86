"""A generation model's worker embedding with its own model: the final hidden states (after the
last norm) pooled by mean or last token and normalised, equal to transformers' own forward within
1e-5 in float32, for prompts of mixed lengths in one batch, while generation requests share the
worker and still equal ``generate`` token for token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.engines.native.core import NativeCore
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.protocol import ErrorCode

pytestmark = pytest.mark.integration

BATCHING = DynamicBatchingConfig(max_wait_ms=30, max_batch_size=8, max_seq_len=256, buckets=(16, 64))
TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "zzz 12345 éé 世界",
    "Redis streams carry prompts to workers that batch them.",  # 56 tokens (bytes) here
]


def hf_vectors(reference, texts: list[str], pooling: str, limit: int = 64) -> np.ndarray:
    """transformers' forward of each text alone (its first ``limit`` tokens): its last hidden
    states pooled, normalised."""
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([reference.tokenizer(text)["input_ids"][:limit]])
            states = reference.model.model(input_ids=ids).last_hidden_state[0]
            pooled = states[-1] if pooling == "last" else states.mean(0)
            out.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return np.asarray(out, dtype=np.float32)


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-5, np.abs(got - want).max(1)  # per row


def test_a_generation_worker_embeds_with_its_own_model(run_worker, redis_url, prefix, tiny_model, reference):
    with run_worker(BATCHING) as running:
        client = Client(redis_url, model=tiny_model, prefix=prefix)
        # generation requests beside the embeddings, running while they are taken
        prompts = ["Once upon a time", "a", "tokenfleet!"]
        handles = [client.submit(p, max_new_tokens=24, temperature=0, ignore_eos=True) for p in prompts]
        mean = np.asarray(client.embed(TEXTS))
        last = np.asarray(client.embed(TEXTS, pooling="last"))
        for prompt, handle in zip(prompts, handles, strict=True):
            want = reference.greedy(reference.ids(prompt), 24, ignore_eos=True)
            assert handle.result(timeout=120).token_ids == want, prompt
        assert_close(mean, hf_vectors(reference, TEXTS, "mean"))
        assert_close(last, hf_vectors(reference, TEXTS, "last"))
        assert len(TEXTS) in running.prefill_sizes  # the mixed lengths went through in one pass
        short = np.asarray(client.embed(TEXTS[:2], dimensions=16))
        want = hf_vectors(reference, TEXTS[:2], "mean")[:, :16]
        assert_close(short, want / np.linalg.norm(want, axis=1, keepdims=True))
        raw = np.asarray(client.embed(TEXTS[:1], normalize=False))
        assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3  # not normalised when asked not to be
        ids = reference.ids("word " * 20)  # past the largest bucket (64): refused alone, not cut
        with pytest.raises(RequestFailed) as failed:
            client.embed([ids])
        assert failed.value.code == ErrorCode.PROMPT_TOO_LONG
        cut = np.asarray(client.embed(["word " * 20]))  # text is cut to the largest bucket
        assert_close(cut, hf_vectors(reference, ["word " * 20], "mean", limit=64))
        # their K/V blocks are freed after the pass, and never named: no prefix-cache entry
        core = running.core._core
        assert isinstance(core, NativeCore)
        allocator = core.scheduler.allocator
        cached = allocator.num_cached_blocks
        client.embed(TEXTS)
        assert allocator.num_cached_blocks == cached and allocator.num_used_blocks == 0


def test_a_flood_of_embeddings_takes_turns_with_generation(runner, reference):
    """Embedding batches and generation steps alternate while generation has work: a generation
    request that arrives behind 40 due embedding requests is prefilled by the second step, and
    decodes every other step until the embeddings are done."""
    import time

    from tokenfleet.core.sequence import SeqState
    from tokenfleet.protocol import Request
    from tokenfleet.protocol.embed import EmbedSpec

    batching = DynamicBatchingConfig(max_wait_ms=0, max_batch_size=8, max_seq_len=256, buckets=(16, 64))
    core = NativeCore(runner, batching)
    for i in range(40):
        request = Request(id=f"e{i}", prompt="word", embed=EmbedSpec())
        assert (
            core.add(SeqState(f"e{i}", request, reference.ids("word"), None, frozenset(), time.time()), 0.0)
            is None
        )
    generation = Request(id="g", prompt="Hello", max_new_tokens=4, ignore_eos=True)
    seq = SeqState(
        "g", generation, reference.ids("Hello"), runner.tokenizer, runner.eos_token_ids, time.time()
    )
    assert core.add(seq, 0.0) is None
    kinds = []
    while core.has_work:
        output = core.step()
        kinds.append("embed" if output.embedded else "generate")
    assert kinds[:2] == ["embed", "generate"], kinds  # the prefill came second, not after all 5 batches
    assert kinds[:9] == ["embed", "generate"] * 4 + ["embed"], kinds
    assert seq.generated == reference.greedy(reference.ids("Hello"), 4, ignore_eos=True)


def test_a_full_pool_or_a_failed_pass_costs_the_embeddings_alone(runner, reference):
    """With no free KV block an embedding batch waits (no step fails); a pass that raises fails
    its embedding requests and nothing else (the generating sequence goes on)."""
    import time

    from tokenfleet.core.sequence import SeqState
    from tokenfleet.protocol import Request
    from tokenfleet.protocol.embed import EmbedSpec

    batching = DynamicBatchingConfig(max_wait_ms=0, max_batch_size=8, max_seq_len=256, buckets=(16, 64))
    core = NativeCore(runner, batching)
    allocator = core.scheduler.allocator

    def embedding(key: str) -> SeqState:
        request = Request(id=key, prompt="word", embed=EmbedSpec())
        return SeqState(key, request, reference.ids("word"), None, frozenset(), time.time())

    hog = allocator.num_free_blocks * allocator.block_size
    allocator.allocate("hog", [1] * hog)  # every block held
    assert core.add(embedding("e0"), 0.0) is None
    output = core.step()
    assert not output.embedded and not output.failed and core.num_waiting == 1
    allocator.free("hog")
    assert [seq.key for seq, _ in core.step().embedded] == ["e0"]

    generation = Request(id="g", prompt="Hello", max_new_tokens=6, ignore_eos=True)
    seq = SeqState(
        "g", generation, reference.ids("Hello"), runner.tokenizer, runner.eos_token_ids, time.time()
    )
    assert core.add(seq, 0.0) is None
    core.step()  # its prefill

    class Broken:
        def prefill(self, *args, **kwargs):
            raise RuntimeError("out of memory")

    core.embeds.runner = Broken()  # a fault in the embedding pass only
    assert core.add(embedding("e1"), 0.0) is None
    output = core.step()
    assert [(s.key, why) for s, why in output.failed] == [("e1", "the embedding pass failed: out of memory")]
    while core.has_work:
        core.step()
    assert seq.generated == reference.greedy(reference.ids("Hello"), 6, ignore_eos=True)
    assert allocator.num_used_blocks == 0
