"""The Grafana dashboard (deploy/grafana/tokenfleet.json) asks only for series tokenfleet exports."""

import json
import re
from pathlib import Path

from tokenfleet.gateway.app import _Metrics
from tokenfleet.worker.metrics import WorkerMetrics

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "tokenfleet.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported() -> set[str]:
    """Every series name a worker and a gateway can export, labels or not."""
    names = set()
    for registry in (WorkerMetrics("w", "model").registry, _Metrics().registry):
        for family in registry.collect():
            names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return names


def test_every_query_names_an_exported_series_and_panels_do_not_overlap():
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported()
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"\b(?:tokenfleet|vllm)[a-z0-9_:]*", target["expr"]))
    assert queried and queried <= names, sorted(queried - names)
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dashboard["panels"]]
    assert len(cells) == len(set(cells))


def test_vllm_named_twins_are_exported_with_vllm_labels():
    names = exported()
    for name in [
        "vllm:request_queue_time_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
    ]:
        assert name in names, name
    metrics = WorkerMetrics("worker-1", "smollm2")
    metrics.state(running=2, waiting={"interactive": 1, "batch": 3}, kv_used=5, kv_total=20)
    value = metrics.registry.get_sample_value
    labels = {"model_name": "smollm2", "engine": "worker-1"}
    assert value("vllm:num_requests_waiting", labels) == 4
    assert value("vllm:kv_cache_usage_perc", labels) == 0.25
    assert value("tokenfleet_requests_waiting", {"worker": "worker-1", "lane": "batch"}) == 3
