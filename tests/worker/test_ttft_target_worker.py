"""A worker with a TTFT target: the interactive lane's wait is tuned within ``max_wait_ms`` and
exported as a metric, while the batch lane keeps ``max_wait_ms``. Real Redis, real tiny model."""

import pytest


def test_a_worker_with_a_ttft_target_tunes_and_exports_its_wait(run_worker, redis_url, prefix, model_path):
    """On a real worker: the interactive lane's wait leaves its start and stays within
    max_wait_ms, the metric reports the wait in force, and the batch lane keeps max_wait_ms."""
    import time

    from tokenfleet.config import DynamicBatchingConfig
    from tokenfleet.producer import Client

    batching = DynamicBatchingConfig(
        max_wait_ms=80, max_batch_size=8, max_seq_len=256, buckets=(16, 32, 64), ttft_target_ms=400
    )
    client = Client(redis_url, model=str(model_path), prefix=prefix)
    with run_worker(batching) as running:
        batcher, metrics = running.core.batcher, running.worker.metrics
        handles = []
        for i in range(30):  # ~10 requests/s for 3 s, well inside the target
            handles.append(client.submit(f"tune {i}", max_new_tokens=4))
            time.sleep(0.1)
        assert all(len(h.result(timeout=60).token_ids) == 4 for h in handles)
    wait = batcher.wait_of(0)  # the worker has stopped: what it last chose
    exported = metrics.registry.get_sample_value(
        "tokenfleet_batch_wait_ms", {"worker": running.worker.name, "lane": "interactive"}
    )
    assert 0 < wait <= 0.08
    assert exported == pytest.approx(wait * 1000)
    assert batcher.wait_of(1) == 0.08
