"""The Kubernetes manifests (deploy/k8s): every object of every overlay validates against the
Kubernetes schemas (kubernetes-validate, strict) and KEDA's own CRD schemas (vendored from KEDA's
repository, checked as kubeconform does); KEDA's triggers read the gateway's queue totals at the
Service the manifests define, and the lag KEDA would read there follows a real queue (bucket
streams and affinity shards) on a real Redis."""

from __future__ import annotations

import copy
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import missing

from tokenfleet.protocol import LANES

ROOT = Path(__file__).parents[2]
K8S = ROOT / "deploy" / "k8s"
KEDA_CRDS = Path(__file__).parent / "schemas" / "keda"  # KEDA v2.20 (commit 8b4f083), Apache-2.0
KUBERNETES_VERSION = "1.31.0"  # the oldest Kubernetes the manifests promise to work on
KUSTOMIZATIONS = [K8S, K8S / "overlays" / "gpu", K8S / "overlays" / "ascend"]
# what KEDA's metrics-api scaler reads from a trigger's metadata (pkg/scalers/metrics_api_scaler.go)
METRICS_API_KEYS = {
    *("url", "valueLocation", "format", "targetValue", "activationTargetValue", "authMode"),
    *("unsafeSsl", "method", "aggregateFromKubeServiceEndpoints", "aggregationType"),
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
    assert {"Deployment", "StatefulSet", "Service", "ScaledObject"} <= kinds
    for doc in docs:
        validate(doc, crds)
        if doc["kind"] == "ScaledObject":
            for trigger in doc["spec"]["triggers"]:
                assert trigger["type"] == "metrics-api"
                assert set(trigger["metadata"]) <= METRICS_API_KEYS, trigger["name"]


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


def triggers(docs: list[dict[str, Any]]) -> list[dict[str, str]]:
    [scaled] = [d for d in docs if d["kind"] == "ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "tokenfleet-worker"
    return [t["metadata"] for t in scaled["spec"]["triggers"]]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)) or "base")
def test_keda_reads_every_lanes_totals_from_the_gateway_service(kustomization):
    docs = render(kustomization)
    [service, gateway] = [
        next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == "tokenfleet-gateway")
        for kind in ("Service", "Deployment")
    ]
    [container] = gateway["spec"]["template"]["spec"]["containers"]
    serve_port = int(container["args"][container["args"].index("--port") + 1])
    [port] = service["spec"]["ports"]
    assert {p["containerPort"] for p in container["ports"] if p["name"] == port["targetPort"]} == {serve_port}
    expected_host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    found = set()
    for trigger in triggers(docs):
        url = urlsplit(trigger["url"])
        assert (url.hostname, url.port, url.path) == (expected_host, port["port"], "/fleet/queues")
        assert trigger["activationTargetValue"] == "0"  # one queued request wakes a fleet at zero
        found.add(trigger["valueLocation"])
    assert found == {f"{lane}.{k}" for lane in LANES for k in ("lag", "pending")}


def test_the_lag_keda_reads_rises_with_queued_requests_and_returns_to_zero(
    run_worker, gateways, redis_url, prefix, r, model_path
):
    from tokenfleet.config import DynamicBatchingConfig
    from tokenfleet.producer import Client

    [config] = [d for d in render(K8S) if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tokenfleet"]
    buckets = [int(b) for b in config["data"]["TOKENFLEET_BUCKETS"].split(",")]
    gateway = gateways()

    def read(location: str) -> int:
        """What KEDA's metrics-api trigger reads: the JSON at the trigger's valueLocation."""
        value: Any = httpx.get(gateway.url + "/fleet/queues", timeout=10).json()
        for part in location.split("."):
            value = value[part]
        return int(value)

    def lag() -> int:
        return sum(read(f"{lane}.lag") for lane in LANES)

    client = Client(redis_url, model=str(model_path), prefix=prefix)
    r.sadd(client.keys.buckets, *buckets)  # a fleet scaled to zero: its buckets stay announced
    assert lag() == 0
    queued = [
        client.submit(f"scale me {i}", max_new_tokens=4, priority=("interactive", "batch")[i % 2])
        for i in range(10)
    ]
    assert {h.stream_key.rsplit(":", 1)[-1][0] for h in queued} == {"s"}  # on affinity shards
    assert len({h.stream_key for h in queued}) > 2
    assert (read("interactive.lag"), read("batch.lag")) == (5, 5)
    batching = DynamicBatchingConfig(max_wait_ms=5, max_batch_size=4, buckets=tuple(buckets))
    with run_worker(batching, trim_interval_s=0.2) as running:  # KEDA's activation: a worker comes up
        assert [len(h.result(timeout=120).token_ids) for h in queued] == [4] * 10
        more = [client.submit(f"again {i}", max_new_tokens=4) for i in range(6)]
        [h.result(timeout=120) for h in more]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(r.xlen(h.stream_key) for h in queued + more):
            time.sleep(0.1)  # trimmed as acknowledged: lag must stay computable after trims
        assert running.worker.requests_finished == 16
    assert lag() == 0
    assert sum(read(f"{lane}.pending") for lane in LANES) == 0
