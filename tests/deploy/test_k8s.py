"""deploy/k8s/: plain manifests that parse, fit together, and run the one builder's worker command
for device 0 (one NPU per pod, issue 4)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mineru_gateway.entry.cli import build_parser
from mineru_gateway.workers.launcher import VllmOptions, build_vllm_command
from tests.deploy.support import ROOT
from tests.deploy.worker_image import command_in, use_worker_image_env

K8S = ROOT / "deploy" / "k8s"

Manifest = dict[str, Any]


@pytest.fixture
def worker_image_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return use_worker_image_env(monkeypatch)


def manifests() -> Iterator[tuple[Path, Manifest]]:
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for doc in yaml.safe_load_all(path.read_text()):
                yield path, doc


def one(kind: str, name: str) -> Manifest:
    found = [
        doc for _, doc in manifests() if doc["kind"] == kind and doc["metadata"]["name"] == name
    ]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def container(workload: Manifest) -> Manifest:
    containers: list[Manifest] = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def port_named(spec: Manifest, name: str) -> int:
    ports = {port["name"]: port["containerPort"] for port in spec["ports"]}
    return ports[name]


def test_every_manifest_parses_and_kustomize_lists_them_all() -> None:
    docs = list(manifests())
    assert docs
    for path, doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
        assert doc["metadata"]["name"], path
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_the_worker_pod_runs_the_builders_command_for_device_0(
    worker_image_env: dict[str, str],
) -> None:
    workers = one("StatefulSet", "mineru-worker")
    spec = container(workers)
    assert "command" not in spec  # keeps the image's entrypoint (CANN's environment)
    command = command_in(spec["args"], worker_image_env)
    model = "/models/MinerU2.5-2509-1.2B"
    expected = build_vllm_command(0, VllmOptions(model, "python3", host="0.0.0.0"))
    assert command == expected
    assert command.env["ASCEND_RT_VISIBLE_DEVICES"] == "0"
    assert port_named(spec, "http") == command.port
    assert spec["resources"]["limits"]["huawei.com/Ascend910"] == 1


def test_worker_probes_allow_for_vllms_slow_start() -> None:
    spec = container(one("StatefulSet", "mineru-worker"))
    startup = spec["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # minutes on NPUs
    assert spec["livenessProbe"]["httpGet"]["path"] == "/health"
    assert spec["readinessProbe"]["httpGet"]["path"] == "/health"


def test_the_gateway_lists_every_worker_pod_by_its_stable_name(
    worker_image_env: dict[str, str],
) -> None:
    workers = one("StatefulSet", "mineru-worker")
    headless = one("Service", workers["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    pod_labels = workers["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    port = command_in(container(workers)["args"], worker_image_env).port
    assert headless["spec"]["ports"][0]["port"] == port

    gateway = container(one("Deployment", "mineru-gateway"))
    env = {item["name"]: item["value"] for item in gateway["env"]}
    # Every worker pod is found through the headless Service's DNS name.
    assert env["MINERU_GATEWAY_WORKER_DNS"] == f"http://{headless['metadata']['name']}:{port}"
    assert "MINERU_GATEWAY_WORKERS" not in env


def test_the_gateway_deployment_serves_with_readiness_on_ready() -> None:
    deployment = one("Deployment", "mineru-gateway")
    spec = container(deployment)
    args = build_parser().parse_args(spec["args"][1:])
    assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", "30000")
    assert spec["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert spec["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert port_named(spec, "http") == 30000
    service = one("Service", "mineru-gateway")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["port"] == 30000


@pytest.mark.parametrize("workload", ["StatefulSet/mineru-worker", "Deployment/mineru-gateway"])
def test_selectors_match_their_pods(workload: str) -> None:
    kind, name = workload.split("/")
    doc = one(kind, name)
    selector = doc["spec"]["selector"]["matchLabels"]
    assert selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()
