"""docker-compose.yml and the images: valid for Compose, and every worker runs the one builder's
command with its own NPU, port and HCCL ports (issue 4). No Docker engine is needed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from mineru_gateway.entry.cli import build_parser
from tests.deploy.support import PROMETHEUS_YML, ROOT
from tests.deploy.worker_image import DOCKER_DIR, command_in, use_worker_image_env

COMPOSE_FILE = ROOT / "docker-compose.yml"
WORKERS = 4
NPU_CONTROL_DEVICES = {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"}


@pytest.fixture
def worker_image_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return use_worker_image_env(monkeypatch)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """`docker-compose config`: the file as Compose itself reads it, defaults interpolated."""
    tool = shutil.which("docker-compose")
    assert tool, "docker-compose is not installed: run `make system-deps` (Debian's docker-compose)"
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    result = subprocess.run(
        [tool, "-f", str(COMPOSE_FILE), "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    config: dict[str, Any] = yaml.safe_load(result.stdout)
    return config


def test_compose_has_a_worker_per_npu_and_the_supporting_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    workers = [f"worker-{i}" for i in range(WORKERS)]
    assert set(services) == {*workers, "gateway", "npu-exporter", "prometheus", "grafana"}
    for name in workers:
        build = services[name]["build"]
        assert build["dockerfile"] == "deploy/docker/Dockerfile.worker"
        assert build["args"]["VLLM_ASCEND_IMAGE"] == "quay.io/ascend/vllm-ascend:v0.10.2rc1"
        assert services[name]["init"] is True
        assert services[name]["shm_size"]
        mounts = {volume.split(":")[1] for volume in services[name]["volumes"]}
        assert {"/usr/local/Ascend/driver", "/usr/local/dcmi", "/models"} <= mounts


@pytest.mark.parametrize("index", range(WORKERS))
def test_each_worker_runs_the_launcher_on_its_own_npu_port_and_hccl_ports(
    compose: dict[str, Any], worker_image_env: dict[str, str], index: int
) -> None:
    service = compose["services"][f"worker-{index}"]
    command = command_in(service["command"], worker_image_env)
    assert command.argv[0] == "python3"  # the image's Python, where vLLM-Ascend is
    # One NPU per container, seen as device 0; the worker index keeps ports apart.
    assert set(service["devices"]) == {f"/dev/davinci{index}", *NPU_CONTROL_DEVICES}
    assert command.env["ASCEND_RT_VISIBLE_DEVICES"] == "0"
    assert command.port == 30001 + index
    assert command.env["HCCL_IF_BASE_PORT"] == str(61000 + 64 * index)
    assert command.host == "0.0.0.0"
    assert "--logits-processors" in command.argv  # MinerU's model
    health = " ".join(service["healthcheck"]["test"])
    assert f"http://127.0.0.1:{command.port}/health" in health
    gateway_workers = compose["services"]["gateway"]["environment"]["MINERU_GATEWAY_WORKERS"]
    assert gateway_workers.split(",")[index] == command.url(f"worker-{index}")


def test_the_gateway_knows_every_worker_and_prometheus_scrapes_them(
    compose: dict[str, Any], worker_image_env: dict[str, str]
) -> None:
    services = compose["services"]
    urls = [
        command_in(services[f"worker-{i}"]["command"], worker_image_env).url(f"worker-{i}")
        for i in range(WORKERS)
    ]
    gateway = services["gateway"]
    assert gateway["environment"]["MINERU_GATEWAY_WORKERS"] == ",".join(urls)
    build_parser().parse_args(gateway["command"][1:])  # flags the CLI accepts
    assert "--port=30000" in gateway["command"]
    assert gateway["ports"][0]["target"] == 30000
    scraped = PROMETHEUS_YML.read_text()
    for url in urls:
        assert url.removeprefix("http://") in scraped
    assert "gateway:30000" in scraped and "npu-exporter:8083" in scraped


def test_npu_exporter_runs_the_cli_with_npu_smi_and_the_driver(compose: dict[str, Any]) -> None:
    exporter = compose["services"]["npu-exporter"]
    args = build_parser().parse_args(exporter["command"][1:])
    assert args.command == "npu-exporter" and args.port == 8083 and args.host == "0.0.0.0"
    mounts = {volume.split(":")[1] for volume in exporter["volumes"]}
    assert {args.npu_smi, "/usr/local/Ascend/driver"} <= mounts
    assert {f"/dev/davinci{i}" for i in range(WORKERS)} <= set(exporter["devices"])


def test_prometheus_and_grafana_mount_the_repositorys_configuration(
    compose: dict[str, Any],
) -> None:
    prometheus = compose["services"]["prometheus"]
    assert f"{ROOT}/deploy/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    grafana = compose["services"]["grafana"]
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/provider.yml").read_text()
    )
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert f"{ROOT}/deploy/grafana/dashboards:{dashboards_path}:ro" in grafana["volumes"]
    assert f"{ROOT}/deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]


@pytest.mark.parametrize("dockerfile", ["Dockerfile.worker", "Dockerfile.gateway"])
def test_dockerfiles_copy_only_files_that_exist(dockerfile: str) -> None:
    text = (DOCKER_DIR / dockerfile).read_text()
    sources = [
        source
        for line in text.splitlines()
        if line.startswith("COPY ")
        for source in line.split()[1:-1]
    ]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not any(
        re.fullmatch(pattern.replace("*", ".*"), s) for pattern in ignored for s in sources
    )


def test_worker_entrypoint_runs_its_command_in_the_same_process(tmp_path: Path) -> None:
    entrypoint = DOCKER_DIR / "worker-entrypoint.sh"
    assert os.access(entrypoint, os.X_OK)
    proc = subprocess.Popen(
        [str(entrypoint), "sh", "-c", "echo $$"], stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.strip() == str(proc.pid)  # exec all the way: vLLM will get the signals
