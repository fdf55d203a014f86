"""Greedy output through a worker and Redis equals ``model.generate`` token for token, with each
token sent once: in every batching mode with mixed lengths and staggered arrivals, and with a KV
pool small enough to force preemption. (The same matrix in-process: tests/engine/test_engine.py.)"""

import time

import pytest
from conftest import TEST_DEVICE, make_runner

from tokenfleet import protocol
from tokenfleet.config import DynamicBatchingConfig, KVCacheConfig
from tokenfleet.producer import Client
from tokenfleet.protocol import Keys

PROMPTS = [
    "Hi",
    "A longer prompt about queues and streams",
    "zz",
    "Once upon a time, far away",
    "x y z",
    "The paged cache holds blocks",
    "q",
    "tokenfleet serves fleets",
]


def submit_staggered(client, prompts, max_new, gap_s=0.03, **kw):
    handles = []
    for p in prompts:
        handles.append((p, client.submit(p, max_new_tokens=max_new, **kw)))
        time.sleep(gap_s)
    return handles


def check_replies(r, prefix, handles, reference, max_new, **ref_kw):
    for prompt, handle in handles:
        res = handle.result(timeout=120)
        assert res.token_ids == reference.greedy(reference.ids(prompt), max_new, **ref_kw), prompt
        events = [protocol.decode_event(f) for _, f in r.xrange(Keys(prefix).reply_stream(handle.id))]
        indices = [e.index for e in events if e.type == "token"]
        assert indices == list(range(len(res.token_ids))), "duplicate or missing token events"
        assert [e.type for e in events].count("done") == 1


@pytest.mark.parametrize("mode", ["static", "dynamic", "continuous"])
def test_every_mode_matches_generate_with_staggered_mixed_lengths(
    run_worker, redis_url, prefix, r, model_path, reference, mode
):
    batching = DynamicBatchingConfig(
        max_wait_ms=40, max_batch_size=4, max_seq_len=128, buckets=(64,), mode=mode
    )
    with run_worker(batching) as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        handles = submit_staggered(client, PROMPTS, max_new=10)
        check_replies(r, prefix, handles, reference, 10)
    assert sum(running.prefill_sizes) >= len(PROMPTS)
    if mode == "static":
        assert running.prefill_sizes == [4, 4]


def test_small_pool_preempts_and_every_request_completes_without_duplicates(
    tiny_model, redis_url, prefix, r, model_path, reference
):
    from conftest import RunningWorker

    # 16 blocks of 4 tokens = 64 slots for 6 sequences of up to ~40 tokens each
    small = make_runner(
        tiny_model, device=TEST_DEVICE, dtype="float32", kv=KVCacheConfig(block_size=4, num_blocks=16)
    )
    batching = DynamicBatchingConfig(
        max_wait_ms=10, max_batch_size=6, max_seq_len=128, buckets=(32,), mode="continuous"
    )
    with RunningWorker(small, redis_url, prefix, batching) as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        short = ["Hi", "zz", "x y z", "q", "Once upon", "fleet!"]
        handles = submit_staggered(client, short, max_new=28, gap_s=0.01, ignore_eos=True)
        check_replies(r, prefix, handles, reference, 28, ignore_eos=True)
        assert running.core.scheduler.preemptions > 0, "the pool was never short: the test proves nothing"
