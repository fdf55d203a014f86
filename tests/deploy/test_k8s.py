"""The Kubernetes manifests (deploy/k8s): every object of every overlay validates against the
Kubernetes schemas (kubernetes-validate, strict) and KEDA's own CRD schemas (vendored from KEDA's
repository, checked as kubeconform does); KEDA's triggers name the streams and the consumer group
the workers really use, and the lag KEDA would read follows a real queue on a real Redis."""

from __future__ import annotations

import copy
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import missing

from tokenfleet.protocol import GROUP, Keys

ROOT = Path(__file__).parents[2]
K8S = ROOT / "deploy" / "k8s"
KEDA_CRDS = Path(__file__).parent / "schemas" / "keda"  # KEDA v2.20 (commit 8b4f083), Apache-2.0
KUBERNETES_VERSION = "1.31.0"  # the oldest Kubernetes the manifests promise to work on
KUSTOMIZATIONS = [K8S, K8S / "overlays" / "gpu", K8S / "overlays" / "ascend"]
# what KEDA's redis-streams scaler reads from a trigger's metadata (pkg/scalers/redis_streams_scaler.go)
REDIS_STREAMS_KEYS = {
    *("stream", "consumerGroup", "lagCount", "pendingEntriesCount", "streamLength"),
    *("activationLagCount", "address", "addressFromEnv", "host", "port", "username", "password"),
    *("databaseIndex", "enableTLS", "unsafeSsl"),
}


def render(kustomization: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        missing("kubectl", "kubectl (its built-in kustomize) renders the overlays")
    out = subprocess.run(
        [kubectl, "kustomize", str(kustomization)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def strict(schema: Any) -> Any:
    """An OpenAPI v3 schema of a CRD as a JSON schema, as kubeconform's openapi2jsonschema makes it
    in strict mode: objects with known properties take no others; int-or-string is either."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["oneOf"] = [{"type": "string"}, {"type": "integer"}]
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> JSON schema, for every version of every vendored KEDA CRD."""
    schemas = {}
    for path in KEDA_CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schemas[(f"{group}/{version['name']}", kind)] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


def validate(doc: dict[str, Any], crds: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Raise if ``doc`` is not a valid object of its kind."""
    key = (doc["apiVersion"], doc["kind"])
    if key in crds:
        jsonschema.validate(doc, crds[key])
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)) or "base")
def test_every_manifest_validates_against_kubernetes_and_keda_schemas(kustomization):
    crds = crd_schemas()
    docs = render(kustomization)
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "StatefulSet", "Service", "ScaledObject", "TriggerAuthentication"} <= kinds
    for doc in docs:
        validate(doc, crds)
        if doc["kind"] == "ScaledObject":
            for trigger in doc["spec"]["triggers"]:
                assert trigger["type"] == "redis-streams"
                assert set(trigger["metadata"]) <= REDIS_STREAMS_KEYS, trigger["name"]


def test_the_validators_catch_a_wrong_field_or_type():
    crds = crd_schemas()
    docs = {doc["kind"]: doc for doc in render(K8S)}
    for kind, path, value in [
        ("ScaledObject", ("spec", "minReplicaCount"), "zero"),
        ("ScaledObject", ("spec", "pollingIntervall"), 5),  # a typo'd field
        ("Deployment", ("spec", "replicas"), "two"),
        ("Deployment", ("spec", "template", "spec", "terminationGracePeriod"), 60),
    ]:
        broken = copy.deepcopy(docs[kind])
        node = broken
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
        with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
            validate(broken, crds)


def fleet_settings(docs: list[dict[str, Any]]) -> tuple[str, list[int]]:
    """The prefix and buckets every worker of the manifests runs with (ConfigMap, no overrides)."""
    [config] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tokenfleet"]
    [worker] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tokenfleet-worker"]
    [container] = worker["spec"]["template"]["spec"]["containers"]
    assert not any(a.startswith(("--prefix", "--buckets")) for a in container["args"])
    assert not {e["name"] for e in container.get("env", [])} & {"TOKENFLEET_PREFIX", "TOKENFLEET_BUCKETS"}
    assert {"configMapRef": {"name": "tokenfleet"}} in container["envFrom"]
    buckets = [int(b) for b in config["data"]["TOKENFLEET_BUCKETS"].split(",")]
    return config["data"]["TOKENFLEET_PREFIX"], buckets


def triggers(docs: list[dict[str, Any]]) -> list[dict[str, str]]:
    [scaled] = [d for d in docs if d["kind"] == "ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "tokenfleet-worker"
    return [t["metadata"] for t in scaled["spec"]["triggers"]]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)) or "base")
def test_keda_watches_exactly_the_streams_and_group_the_workers_read(kustomization):
    docs = render(kustomization)
    prefix, buckets = fleet_settings(docs)
    read = {stream for lane in Keys(prefix).lane_streams(buckets) for stream in lane}
    for factor in ("lagCount", "pendingEntriesCount"):
        watched = [t for t in triggers(docs) if factor in t]
        assert sorted(t["stream"] for t in watched) == sorted(read), factor
        assert {t["consumerGroup"] for t in watched} == {GROUP}
        assert all(t["activationLagCount"] == "0" for t in watched)  # one request wakes a fleet at zero


def keda_lag(r, stream: str, group: str) -> int:
    """What KEDA's lagCount trigger reads (redis_streams_scaler.go): no stream, 0; the group's
    ``lag`` (go-redis reads a null lag as 0: it must never be null); no group yet, the length."""
    if not r.exists(stream):
        return 0
    for info in r.xinfo_groups(stream):
        if info["name"] in (group, group.encode()):
            assert info["lag"] is not None, f"Redis cannot compute {stream}'s lag: KEDA would read 0"
            return int(info["lag"])
    return int(r.xlen(stream))


def test_the_lag_keda_reads_rises_with_queued_requests_and_returns_to_zero(
    run_worker, redis_url, prefix, r, model_path
):
    from tokenfleet.config import DynamicBatchingConfig
    from tokenfleet.producer import Client

    docs = render(K8S)
    manifest_prefix, buckets = fleet_settings(docs)
    mine = Keys(prefix)  # the manifests' streams under this test's own prefix

    def stream_of(trigger: dict[str, str]) -> str:
        return trigger["stream"].replace(Keys(manifest_prefix).tag, mine.tag, 1)

    watched = [t for t in triggers(docs) if "lagCount" in t]

    def lag() -> int:
        return sum(keda_lag(r, stream_of(t), t["consumerGroup"]) for t in watched)

    assert lag() == 0
    client = Client(redis_url, model=str(model_path), prefix=prefix)
    # a fleet at zero replicas: nobody serves, every request waits where KEDA looks
    queued = [
        client.submit(f"scale me {i}", max_new_tokens=4, priority=("interactive", "batch")[i % 2])
        for i in range(10)
    ]
    assert lag() == 10
    batching = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, buckets=tuple(buckets))
    with run_worker(batching, trim_interval_s=0.2) as running:  # KEDA's activation: a worker comes up
        assert [len(h.result(timeout=120).token_ids) for h in queued] == [4] * 10
        more = [client.submit(f"again {i}", max_new_tokens=4) for i in range(6)]
        [h.result(timeout=120) for h in more]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(r.xlen(stream_of(t)) for t in watched):
            time.sleep(0.1)  # trimmed as acknowledged: lag must stay computable after trims
        assert running.worker.requests_finished == 16
    assert lag() == 0
    assert all(keda_lag(r, stream_of(t), GROUP) == 0 and r.xlen(stream_of(t)) == 0 for t in watched)
