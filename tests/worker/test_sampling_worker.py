"""Sampling through a worker: values so small they underflow (a temperature of 1e-40, a top_p of
1e-300) are served, and never fail a batch-mate. Real Redis, real tiny model."""

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.producer import Client


def test_sampling_values_that_underflow_never_fail_a_batch_mate(
    run_worker, redis_url, prefix, model_path, reference
):
    client = Client(redis_url, model=str(model_path), prefix=prefix, buckets=[16, 64])
    with run_worker(
        DynamicBatchingConfig(max_wait_ms=300, max_batch_size=8, max_seq_len=256, buckets=(16, 64))
    ):
        greedy = client.submit("greedy mate", max_new_tokens=6, ignore_eos=True)
        odd = [
            client.submit("tiny temperature", max_new_tokens=6, temperature=1e-40, ignore_eos=True),
            client.submit("tiny top_p", max_new_tokens=6, temperature=1.0, top_p=1e-300, ignore_eos=True),
            client.submit(
                "both", max_new_tokens=6, temperature=1e-300, top_p=1e-300, seed=3, ignore_eos=True
            ),
        ]
        assert greedy.result(timeout=60).token_ids == reference.greedy(reference.ids("greedy mate"), 6, True)
        for handle in odd:
            assert len(handle.result(timeout=60).token_ids) == 6
    # a temperature that tiny samples the most likely token: greedy
    assert odd[0].result(timeout=5).token_ids == reference.greedy(reference.ids("tiny temperature"), 6, True)
