"""deploy/k8s/autoscaling/ and the workers' scale-down drain: the HPA validates against
Kubernetes' schemas, KEDA's ScaledObject (not in kubernetes-validate) against the part of its
CRD it uses, both scale the worker StatefulSet, and every worker pod leaving is drained through
every gateway replica first. tests/fleet/test_backlog.py runs their queries on a real Prometheus.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mineru_gateway.entry.cli import build_parser
from tests.deploy.test_k8s import K8S, KEYS_SECRET, KUBERNETES_VERSION, container, kustomize, one

pytestmark = pytest.mark.unit

AUTOSCALING = K8S / "autoscaling"
HPA, KEDA = AUTOSCALING / "hpa", AUTOSCALING / "keda"
ADAPTER_VALUES = HPA / "prometheus-adapter-rules.yaml"
METRICS = {"mineru_gateway_backlog_seconds", "mineru_gateway_requests_in_flight"}

_QUANTITY = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"}
_POLICY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type", "value", "periodSeconds"],
    "properties": {
        "type": {"enum": ["Pods", "Percent"]},
        "value": {"type": "integer", "minimum": 1},
        "periodSeconds": {"type": "integer", "minimum": 1},
    },
}
_RULES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0},
        "policies": {"type": "array", "items": _POLICY},
    },
}
# keda.sh/v1alpha1 ScaledObject, as in KEDA's config/crd/bases/keda.sh_scaledobjects.yaml: the
# fields these manifests use, strict.
SCALED_OBJECT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                    },
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "behavior": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {"scaleUp": _RULES, "scaleDown": _RULES},
                                }
                            },
                        }
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"const": "prometheus"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "metadata": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["serverAddress", "query", "threshold"],
                                "properties": {
                                    "serverAddress": {"type": "string", "pattern": "^https?://"},
                                    "query": {"type": "string"},
                                    "threshold": _QUANTITY,
                                    "activationThreshold": _QUANTITY,
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


@pytest.mark.parametrize("directory", [HPA, KEDA], ids=["hpa", "keda"])
def test_every_manifest_is_a_resource_of_its_kustomization(directory: Path) -> None:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    files = {path.name for path in directory.glob("*.yaml")}
    files -= {"kustomization.yaml", ADAPTER_VALUES.name}  # Helm values, not a resource
    assert sorted(kustomization["resources"]) == sorted(files)


def test_the_hpa_validates_and_scales_the_workers_on_the_gateways_metrics() -> None:
    (hpa,) = kustomize(HPA)
    kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)
    assert hpa["metadata"]["namespace"] == "mineru"
    assert_scales_the_workers(hpa["spec"]["scaleTargetRef"])
    names = {metric["external"]["metric"]["name"] for metric in hpa["spec"]["metrics"]}
    assert names == METRICS
    assert hpa["spec"]["behavior"]["scaleDown"]["policies"][0]["value"] == 1


def test_the_adapter_serves_the_metrics_the_hpa_reads() -> None:
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    rules = values["rules"]["external"]
    assert {rule["name"]["as"] for rule in rules} == METRICS
    for rule in rules:
        assert set(rule) == {"seriesQuery", "resources", "name", "metricsQuery"}
        assert "<<.Series>>" in rule["metricsQuery"]
        assert "<<.LabelMatchers>>" in rule["metricsQuery"]
        assert rule["seriesQuery"] == rule["name"]["as"]


def test_the_scaled_object_fits_kedas_crd_and_scales_the_workers() -> None:
    (scaled,) = kustomize(KEDA)
    jsonschema.validate(scaled, SCALED_OBJECT)
    assert scaled["metadata"]["namespace"] == "mineru"
    assert_scales_the_workers(scaled["spec"]["scaleTargetRef"])
    triggers = {trigger["name"]: trigger for trigger in scaled["spec"]["triggers"]}
    assert triggers["backlog"]["metricType"] == "Value"
    assert "mineru_gateway_backlog_seconds" in triggers["backlog"]["metadata"]["query"]
    assert "mineru_gateway_requests_in_flight" in triggers["busy"]["metadata"]["query"]


def assert_scales_the_workers(target: dict[str, Any]) -> None:
    workers = one("StatefulSet", "mineru-worker")
    assert (target["apiVersion"], target["kind"]) == (workers["apiVersion"], workers["kind"])
    assert target["name"] == workers["metadata"]["name"]


def pre_stop_drain() -> tuple[str, list[str]]:
    """The worker's preStop script, and the `mineru-gateway workers ... drain` argv in it."""
    hook = container(one("StatefulSet", "mineru-worker"))["lifecycle"]["preStop"]["exec"]
    assert hook["command"][:2] == ["sh", "-c"]
    script = hook["command"][2]
    joined = script.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if "mineru-gateway workers" in line)
    argv = shlex.split(line[line.index("mineru-gateway workers") :].split(">")[0])
    return script, argv


def test_a_worker_leaving_is_drained_through_every_gateway_replica() -> None:
    script, argv = pre_stop_drain()
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.action, args.no_wait) == ("workers", "drain", False)
    # Each replica routes on its own: the hook asks every one, by the headless peers Service.
    peers = re.search(r"getent ahostsv4 (\S+)", script)
    assert peers is not None
    service = one("Service", peers.group(1))
    gateway = one("Deployment", "mineru-gateway")
    assert service["spec"]["clusterIP"] == "None"
    assert (
        service["spec"]["selector"].items()
        <= gateway["spec"]["template"]["metadata"]["labels"].items()
    )
    assert args.gateway == f"http://$ip:{service['spec']['ports'][0]['port']}"
    # The worker's URL as the gateways know it (DNS discovery: its pod address and port).
    workers = one("StatefulSet", "mineru-worker")
    spec = container(workers)
    env = {item["name"]: item for item in spec["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    port = next(p["containerPort"] for p in spec["ports"] if p["name"] == "http")
    assert args.url == f"http://$POD_IP:{port}"
    # The wait fits in the grace period, with time left for vLLM's own shutdown.
    grace = workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert args.timeout_s + 30 <= grace


def test_the_drain_reads_the_admin_key_from_the_gateways_secret() -> None:
    script, _ = pre_stop_drain()
    workers = one("StatefulSet", "mineru-worker")
    volumes = {v["name"]: v for v in workers["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container(workers)["volumeMounts"]}
    secret = yaml.safe_load(KEYS_SECRET.read_text())
    source = volumes[mounts["/etc/mineru-gateway/keys"]]["secret"]
    assert source["secretName"] == secret["metadata"]["name"]
    assert [item["key"] for item in source["items"]] == ["admin-keys"]
    assert "admin-keys" in secret["stringData"]
    assert "/etc/mineru-gateway/keys/admin-keys" in script
