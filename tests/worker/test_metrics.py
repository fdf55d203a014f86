"""Prometheus metrics scraped from a worker during a real run."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet.config import DynamicBatchingConfig
from tokenfleet.errors import RequestFailed
from tokenfleet.producer import Client
from tokenfleet.transport.server.embedded import free_port


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("worker", "engine")))
            samples[(s.name, labels)] = s.value
    return samples


def test_metrics_show_batches_latencies_and_outcomes(run_worker, redis_url, prefix, model_path):
    port = free_port()
    batching = DynamicBatchingConfig(max_wait_ms=50, max_batch_size=16, max_seq_len=256, buckets=(32,))
    with run_worker(batching, metrics_port=port) as running:
        client = Client(redis_url, model=str(model_path), prefix=prefix)
        handles = [client.submit(f"metrics {i}", max_new_tokens=10, ignore_eos=True) for i in range(16)]
        during = scrape(port)  # while the burst runs: the endpoint answers
        for h in handles:
            h.result(timeout=60)
        too_long = client.submit(input_ids=[0] + [5] * 100, max_new_tokens=2)
        with pytest.raises(RequestFailed):
            too_long.result(timeout=30)
        cancelled = client.submit("x", max_new_tokens=200, ignore_eos=True)
        next(iter(cancelled.stream(timeout=30)))
        cancelled.cancel()
        assert cancelled.result(timeout=30).finish_reason == "cancelled"
        m = scrape(port)
    assert running.worker.requests_finished == 17
    assert ("tokenfleet_kv_blocks_total", ()) in during
    count = m[("tokenfleet_prefill_batch_size_count", ())]
    mean_batch = m[("tokenfleet_prefill_batch_size_sum", ())] / count
    assert mean_batch > 1, f"no batching visible: {mean_batch}"
    interactive = (("lane", "interactive"),)
    assert m[("tokenfleet_time_to_first_token_seconds_count", interactive)] >= 16
    assert m[("tokenfleet_time_to_first_token_seconds_sum", interactive)] > 0
    assert m[("tokenfleet_request_queue_time_seconds_count", interactive)] >= 16
    assert ("tokenfleet_requests_waiting", (("lane", "batch"),)) in m
    assert m[("tokenfleet_inter_token_latency_seconds_count", ())] >= 16 * 9
    assert m[("tokenfleet_generation_tokens_total", ())] >= 160
    assert m[("tokenfleet_requests_finished_total", (("reason", "length"),))] == 16
    assert m[("tokenfleet_requests_failed_total", (("code", "prompt_too_long"),))] == 1
    assert m[("tokenfleet_requests_finished_total", (("reason", "cancelled"),))] == 1
    assert m[("tokenfleet_decode_batch_size_count", ())] > 0
    assert m[("tokenfleet_kv_blocks_total", ())] > 0
    # the vLLM-named twins, labelled with the served model's name, agree with ours
    model = (("model_name", running.worker.config.engine.served_name),)
    assert (
        m[("vllm:time_to_first_token_seconds_count", model)]
        == m[("tokenfleet_time_to_first_token_seconds_count", interactive)]
    )
    assert (
        m[("vllm:inter_token_latency_seconds_count", model)]
        == m[("tokenfleet_inter_token_latency_seconds_count", ())]
    )
    assert m[("vllm:e2e_request_latency_seconds_count", model)] == 17
    assert m[("vllm:request_queue_time_seconds_count", model)] >= 16
    assert m[("vllm:generation_tokens_total", model)] == m[("tokenfleet_generation_tokens_total", ())]
    assert m[("vllm:request_success_total", (("finished_reason", "length"), *model))] == 16
    assert m[("vllm:request_success_total", (("finished_reason", "abort"), *model))] == 1
    assert ("vllm:num_requests_waiting", model) in m and ("vllm:num_requests_running", model) in m
    assert 0 <= m[("vllm:kv_cache_usage_perc", model)] <= 1
