"""deploy/k8s/ as a real cluster takes it: the gateway under the Pod Security `restricted` rules
and the namespace at the level the workers need; NetworkPolicies that keep every pod but the
gateway and Prometheus off the workers; workers that tolerate NPU taints, whose count is the
autoscaler's, and whose probes tolerate a busy engine; the gateway's queue well below its memory
limit and /metrics on its own port; the model's claim and download Job outside the app, so that
deleting the app keeps the weights; Ingress and HTTPRoute examples sized for page images.

All read from `kubectl kustomize`'s output (tests/deploy/test_k8s.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mineru_gateway.config import GatewaySettings, default_max_queued_bytes
from mineru_gateway.entry.cli import build_parser, settings_from_args
from tests.deploy.crd_schemas import HTTP_ROUTE
from tests.deploy.test_k8s import (
    K8S,
    KUBERNETES_VERSION,
    MODEL,
    Manifest,
    container,
    kustomize,
    one,
    pod_labels,
    port_named,
)
from tests.deploy.worker_image import DOCKER_DIR

HPA = K8S / "autoscaling" / "hpa"
KEDA = K8S / "autoscaling" / "keda"
EXAMPLES = K8S / "examples"
WORKLOADS = {
    "gateway": ("Deployment", "mineru-gateway"),
    "worker": ("StatefulSet", "mineru-worker"),
    "exporter": ("DaemonSet", "mineru-npu-exporter"),
}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}

# Pod Security Standards, `restricted` (which includes `baseline`): what a pod may have.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
_VOLUME_FIELDS_NOT_TYPES = {"name"}


def workload(name: str) -> Manifest:
    return one(*WORKLOADS[name])


def pod_spec(doc: Manifest) -> Manifest:
    spec: Manifest = doc["spec"]["template"]["spec"]
    return spec


def restricted_violations(pod: Manifest) -> list[str]:
    """What in a pod spec the Pod Security `restricted` level refuses (its published rules),
    plus a writable root filesystem, which this project's gateway must not have either."""
    found = []
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            found.append(flag)
    context = pod.get("securityContext", {})
    for volume in pod.get("volumes", []):
        kinds = set(volume) - _VOLUME_FIELDS_NOT_TYPES
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds)}")
    for spec in [*pod.get("initContainers", []), *pod["containers"]]:
        name = spec["name"]
        own = spec.get("securityContext", {})
        if own.get("privileged"):
            found.append(f"{name}: privileged")
        if own.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        capabilities = own.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities not dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
        if not own.get("runAsNonRoot", context.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot is not true")
        if own.get("runAsUser", context.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = own.get("seccompProfile", context.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile is not RuntimeDefault or Localhost")
        if any("hostPort" in port for port in spec.get("ports", [])):
            found.append(f"{name}: hostPort")
        if not own.get("readOnlyRootFilesystem"):
            found.append(f"{name}: root filesystem writable")
    return found


# ---------------------------------------------------------------------------------------------
# Pod Security


def test_the_gateway_pod_passes_the_restricted_profile() -> None:
    assert restricted_violations(pod_spec(workload("gateway"))) == []


def test_the_restricted_check_refuses_what_the_npu_pods_need() -> None:
    worker = restricted_violations(pod_spec(workload("worker")))
    assert any("hostPath" in found for found in worker)  # the driver from the host
    exporter = restricted_violations(pod_spec(workload("exporter")))
    assert "npu-exporter: privileged" in exporter


def test_the_namespace_admits_the_npu_pods_and_is_outside_the_app() -> None:
    [namespace] = [doc for doc in kustomize(MODEL) if doc["kind"] == "Namespace"]
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"  # hostPath, privileged
    assert labels["pod-security.kubernetes.io/enforce-version"] == "latest"
    # Deleting the app (`kubectl delete -k deploy/k8s/`) must not take the namespace, and the
    # claim with it.
    assert all(doc["kind"] != "Namespace" for doc in kustomize(K8S))


def test_the_gateway_has_a_scratch_tmp_and_no_service_account_token() -> None:
    pod = pod_spec(workload("gateway"))
    assert pod["automountServiceAccountToken"] is False
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {
        mount["mountPath"]: mount["name"]
        for mount in container(workload("gateway"))["volumeMounts"]
    }
    assert "emptyDir" in volumes[mounts["/tmp"]]  # the one writable path: a read-only root


def test_the_gateway_image_runs_as_the_manifests_numeric_user() -> None:
    dockerfile = (DOCKER_DIR / "Dockerfile.gateway").read_text()
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert user is not None, "USER must be numeric for runAsNonRoot"
    uid, gid = int(user.group(1)), int(user.group(2))
    assert re.search(rf"useradd [^\n]*--uid {uid} --gid {gid}\b", dockerfile)
    assert re.search(rf"groupadd [^\n]*--gid {gid}\b", dockerfile)
    context = pod_spec(workload("gateway"))["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (uid, gid, gid)
    assert uid != 0


# ---------------------------------------------------------------------------------------------
# Workers on tainted NPU nodes, counted by the autoscaler


def tolerates(toleration: Manifest, taint: Manifest) -> bool:
    """Kubernetes' matching of one toleration against one taint."""
    if toleration.get("effect") not in (None, "", taint["effect"]):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return toleration.get("key") in (None, "", taint["key"])
    return (toleration.get("key"), toleration.get("value", "")) == (
        taint["key"],
        taint.get("value", ""),
    )


@pytest.mark.parametrize(
    "taint",
    [
        {"key": "huawei.com/Ascend910", "value": "true", "effect": "NoSchedule"},
        {"key": "huawei.com/Ascend910", "effect": "NoSchedule"},
        {"key": "accelerator", "value": "huawei-Ascend910", "effect": "NoSchedule"},
    ],
)
def test_workers_tolerate_the_usual_npu_taints(taint: Manifest) -> None:
    tolerations = pod_spec(workload("worker"))["tolerations"]
    assert any(tolerates(toleration, taint) for toleration in tolerations)
    unrelated = {"key": "dedicated", "value": "database", "effect": "NoSchedule"}
    assert not any(tolerates(toleration, unrelated) for toleration in tolerations)


def test_the_autoscalers_own_the_worker_count() -> None:
    workers = workload("worker")
    assert "replicas" not in workers["spec"]  # `kubectl apply -k` would reset it
    for directory in (HPA, KEDA):
        (scaler,) = kustomize(directory)
        assert scaler["spec"]["scaleTargetRef"]["name"] == workers["metadata"]["name"]
    assert workload("gateway")["spec"]["replicas"] == 2  # no autoscaler: the manifest's


# ---------------------------------------------------------------------------------------------
# NetworkPolicies


def selects(selector: Manifest, labels: dict[str, str]) -> bool:
    match: dict[str, str] = selector.get("matchLabels", {})
    assert set(selector) <= {"matchLabels"}, selector
    return match.items() <= labels.items()


def admits(
    policies: list[Manifest], target: Manifest, source: dict[str, str], namespace: str, port: str
) -> bool:
    """Whether the ingress rules of `policies` let a pod labelled `source` in `namespace` open
    port `port` (by name) of the workload `target`'s pods; unselected pods admit all."""
    labels = pod_labels(target)
    ports = {p["name"]: p["containerPort"] for p in container(target)["ports"]}
    selecting = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
    if not selecting:
        return True
    namespace_labels = {"kubernetes.io/metadata.name": namespace}
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            named = [p["port"] for p in rule.get("ports", [])]
            if named and port not in named and ports[port] not in named:
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for peer in peers:
                in_namespace = (
                    selects(peer["namespaceSelector"], namespace_labels)
                    if "namespaceSelector" in peer
                    else namespace == "mineru"
                )
                by_pod = selects(peer["podSelector"], source) if "podSelector" in peer else True
                if in_namespace and by_pod:
                    return True
    return False


def network_policies() -> list[Manifest]:
    policies = [doc for doc in kustomize(K8S) if doc["kind"] == "NetworkPolicy"]
    assert policies
    return policies


def test_every_pod_of_the_app_is_selected_by_a_policy() -> None:
    policies = network_policies()
    for name in WORKLOADS:
        labels = pod_labels(workload(name))
        assert any(selects(p["spec"]["podSelector"], labels) for p in policies), name
    for policy in policies:
        assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_only_the_gateway_and_prometheus_reach_the_workers() -> None:
    policies, workers = network_policies(), workload("worker")
    gateway = pod_labels(workload("gateway"))
    assert admits(policies, workers, gateway, "mineru", "http")
    assert admits(policies, workers, {"app": "prometheus"}, "monitoring", "http")
    assert not admits(policies, workers, {"app": "anything"}, "mineru", "http")
    assert not admits(policies, workers, {"app": "anything"}, "default", "http")
    assert not admits(policies, workers, gateway, "default", "http")  # its labels elsewhere


def test_the_gateways_metrics_are_prometheus_only_and_its_clients_port_open() -> None:
    policies, gateway = network_policies(), workload("gateway")
    anyone = {"app": "mineru-client"}
    assert admits(policies, gateway, anyone, "default", "http")
    assert admits(policies, gateway, pod_labels(workload("worker")), "mineru", "http")  # drain
    assert not admits(policies, gateway, anyone, "default", "metrics")
    assert not admits(policies, gateway, anyone, "mineru", "metrics")
    assert admits(policies, gateway, {"app": "prometheus"}, "monitoring", "metrics")
    exporter = workload("exporter")
    assert admits(policies, exporter, {"app": "prometheus"}, "monitoring", "metrics")
    assert not admits(policies, exporter, anyone, "mineru", "metrics")


# ---------------------------------------------------------------------------------------------
# The gateway's /metrics port and memory


def gateway_settings(monkeypatch: pytest.MonkeyPatch) -> GatewaySettings:
    """The settings the gateway container starts with: its args and environment."""
    spec = container(workload("gateway"))
    for name in list(os.environ):
        if name.startswith("MINERU_GATEWAY_"):
            monkeypatch.delenv(name)
    for item in spec["env"]:
        monkeypatch.setenv(item["name"], item["value"])
    monkeypatch.setenv("MINERU_GATEWAY_API_KEY_FILES", "")
    monkeypatch.setenv("MINERU_GATEWAY_ADMIN_KEY_FILES", "")
    return settings_from_args(build_parser().parse_args(spec["args"][1:]))


def test_the_gateway_serves_metrics_on_their_own_port(monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = workload("gateway")
    spec = container(deployment)
    settings = gateway_settings(monkeypatch)
    assert settings.metrics_port == port_named(spec, "metrics") != port_named(spec, "http")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(settings.metrics_port)
    service = {p["name"]: p for p in one("Service", "mineru-gateway")["spec"]["ports"]}
    assert service["metrics"]["targetPort"] == "metrics"
    assert service["metrics"]["port"] == settings.metrics_port


def quantity(text: str) -> int:
    """A memory quantity in bytes: 512Mi, 2Gi, or plain bytes."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", text)
    assert match is not None, text
    return int(match.group(1)) * {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, None: 1}[match.group(2)]


def test_the_gateway_queues_well_below_its_memory_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    limit = quantity(container(workload("gateway"))["resources"]["limits"]["memory"])
    gateway_settings(monkeypatch)  # the container's arguments and environment are valid
    env = {item["name"] for item in container(workload("gateway"))["env"]}
    assert "MINERU_GATEWAY_MAX_QUEUED_BYTES" not in env  # derived from the limit below
    (tmp_path / "memory.max").write_text(f"{limit}\n")  # the pod's cgroup, as the kubelet sets it
    queued = default_max_queued_bytes((tmp_path / "memory.max",))
    assert 0 < queued <= limit // 4


# ---------------------------------------------------------------------------------------------
# The model: its claim and download Job, outside the app


def download_job() -> Manifest:
    return one("Job", "mineru-model-download", MODEL)


def test_the_model_claim_and_job_are_outside_the_app() -> None:
    app_kinds = {doc["kind"] for doc in kustomize(K8S)}
    assert not app_kinds & {"PersistentVolumeClaim", "Job", "Namespace"}
    kinds = sorted(doc["kind"] for doc in kustomize(MODEL))
    assert kinds == ["Job", "Namespace", "PersistentVolumeClaim"]


def test_the_job_fills_the_claim_where_the_workers_read_it() -> None:
    job = download_job()
    pod = pod_spec(job)
    worker_pod = pod_spec(workload("worker"))
    claim = one("PersistentVolumeClaim", "mineru-models", MODEL)
    [writes] = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    [reads] = [v for v in worker_pod["volumes"] if "persistentVolumeClaim" in v]
    assert writes["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert reads["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert writes["persistentVolumeClaim"].get("readOnly", False) is False
    assert reads["persistentVolumeClaim"]["readOnly"] is True
    env = {item["name"]: item["value"] for item in container(job)["env"]}
    args = build_parser().parse_args(container(workload("worker"))["args"][1:])
    assert env["MODEL_DIR"] == args.model
    assert env["MODEL_ID"] == "opendatalab/MinerU2.5-2509-1.2B"
    assert container(job)["image"] == container(workload("worker"))["image"]
    assert restricted_violations(pod) == ["download: runAsNonRoot is not true"]  # the image's root


FAKE_HUB = """
import json, os, pathlib
def snapshot_download(repo_id, local_dir):
    log = pathlib.Path(os.environ["FAKE_HUB_LOG"])
    log.write_text(log.read_text() + json.dumps([__name__, repo_id, local_dir]) + "\\n")
    target = pathlib.Path(local_dir)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_text("weights")
"""


def run_download(tmp_path: Path, models: Path, source: str) -> subprocess.CompletedProcess[str]:
    """The Job's container command, with its environment, over `models` as the claim; the hubs
    are small stand-ins on PYTHONPATH (no model hub is reachable here)."""
    spec = container(download_job())
    assert spec["args"][:2] == ["python3", "-c"]
    fakes = tmp_path / "fakes"
    for module in ("huggingface_hub", "modelscope"):
        (fakes / module).mkdir(parents=True, exist_ok=True)
        (fakes / module / "__init__.py").write_text(FAKE_HUB)
    env = {item["name"]: item["value"] for item in spec["env"]}
    env["MODEL_SOURCE"] = source
    env["MODEL_DIR"] = str(models / Path(env["MODEL_DIR"]).relative_to("/models"))
    env |= {"PYTHONPATH": str(fakes), "FAKE_HUB_LOG": str(tmp_path / "hub.log")}
    (tmp_path / "hub.log").touch()
    return subprocess.run(
        [sys.executable, "-c", spec["args"][2]], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("source", ["huggingface", "modelscope"])
def test_the_job_downloads_once_and_renames_when_complete(tmp_path: Path, source: str) -> None:
    models = tmp_path / "models"
    models.mkdir()
    done = run_download(tmp_path, models, source)
    assert done.returncode == 0, done.stderr
    target = models / "MinerU2.5-2509-1.2B"
    assert (target / "config.json").is_file()
    assert sorted(path.name for path in models.iterdir()) == [target.name]  # no .partial left
    calls = [yaml.safe_load(line) for line in (tmp_path / "hub.log").read_text().splitlines()]
    module = "modelscope" if source == "modelscope" else "huggingface_hub"
    assert calls == [[module, "opendatalab/MinerU2.5-2509-1.2B", f"{target}.partial"]]
    again = run_download(tmp_path, models, source)  # a second run: nothing to do
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout
    assert len((tmp_path / "hub.log").read_text().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# Exposing the gateway


def example(name: str) -> Manifest:
    doc: Manifest = yaml.safe_load((EXAMPLES / name).read_text())
    return doc


def seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m|h)?", text)
    assert match is not None, text
    factor = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]
    return int(match.group(1)) * factor


def size(text: str) -> int:
    match = re.fullmatch(r"(\d+)([kmg]?)", text.lower())
    assert match is not None, text
    return int(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2)]


def routed_service_port(name: str, port: Any) -> int:
    service = one("Service", name)
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    number = ports[port] if isinstance(port, str) else port
    assert number == ports["http"]  # the client port, never /metrics'
    return number


def test_the_ingress_example_takes_page_images_and_long_answers() -> None:
    ingress = example("ingress-nginx.yaml")
    kubernetes_validate.validate(ingress, KUBERNETES_VERSION, strict=True)
    annotations = ingress["metadata"]["annotations"]
    defaults = GatewaySettings.model_fields
    assert size(annotations["nginx.ingress.kubernetes.io/proxy-body-size"]) >= (
        defaults["max_body_bytes"].default
    )
    for timeout in ("proxy-read-timeout", "proxy-send-timeout"):
        waited = seconds(annotations[f"nginx.ingress.kubernetes.io/{timeout}"])
        assert waited >= defaults["first_byte_timeout_s"].default
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # streams
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            routed_service_port(backend["name"], backend["port"]["name"])


def test_the_httproute_example_waits_as_long_as_the_gateway() -> None:
    route = example("httproute.yaml")
    jsonschema.validate(route, HTTP_ROUTE)
    defaults = GatewaySettings.model_fields
    for rule in route["spec"]["rules"]:
        for timeout in rule["timeouts"].values():
            assert seconds(timeout) >= defaults["first_byte_timeout_s"].default
        for backend in rule["backendRefs"]:
            routed_service_port(backend["name"], backend["port"])
