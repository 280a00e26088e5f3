from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mineru_gateway.telemetry.exporter import create_exporter_app, parse_device_workers
from mineru_gateway.testing import free_port, wait_http_ok
from tests.support.npu_smi_stub import NpuSmiStub, install_npu_smi, path_with
from tests.support.servers import CliProcess, serve, wait_for_series


@pytest.fixture
def stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NpuSmiStub:
    installed = install_npu_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", path_with(installed.directory))
    return installed


def power_by_id(text: str) -> dict[str, float]:
    return {
        sample.labels["id"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "npu_chip_info_power"
        for sample in family.samples
    }


def test_exporter_app_serves_metrics_and_health(stub: NpuSmiStub) -> None:
    app = create_exporter_app(interval_s=0.1, device_workers={3: "worker-3"})
    with serve(app) as url:
        text = wait_for_series(url, "npu_chip_info_power")
        health = httpx.get(f"{url}/health", timeout=5.0)
    assert power_by_id(text)["5"] == 102.4
    assert 'mineru_gateway_npu_power_watts{chip="0",npu="3",worker="worker-3"} 99.9' in text
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert health.json()["npu_smi_up"] is True


def test_exporter_app_negotiates_openmetrics(stub: NpuSmiStub) -> None:
    app = create_exporter_app(interval_s=0.1, npu_exporter_names=False)
    with serve(app) as url:
        wait_for_series(url, "mineru_gateway_npu_power_watts")
        headers = {"Accept": "application/openmetrics-text; version=1.0.0"}
        response = httpx.get(f"{url}/metrics", headers=headers, timeout=5.0)
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    assert "npu_chip_info" not in response.text


def test_exporter_without_npu_smi_still_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    app = create_exporter_app(interval_s=0.1)
    with serve(app) as url:
        wait_for_series(url, "mineru_gateway_npu_smi_errors_total")
        health = httpx.get(f"{url}/health", timeout=5.0).json()
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
    assert health["npu_smi_up"] is False
    assert "npu_chip_info_power{" not in text
    assert 'mineru_gateway_npu_smi_errors_total{kind="not_found"}' in text


def test_npu_exporter_command_in_its_own_process(stub: NpuSmiStub) -> None:
    port = free_port()
    process = CliProcess.mineru_gateway(
        "npu-exporter",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--npu-smi={stub.path}",
        "--interval-s=0.1",
        "--devices=0=w0",
        "--log-level=warning",
        env={"PATH": "/usr/bin:/bin"},
    )
    proc = process.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", timeout=30.0, proc=proc)
        text = wait_for_series(url, "npu_chip_info_power")
    finally:
        assert process.stop() == 0  # a clean exit on SIGTERM
    assert power_by_id(text)["7"] == 98.8
    assert 'worker="w0"' in text


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", {}),
        ("0=http://10.0.0.5:30001", {0: "http://10.0.0.5:30001"}),
        (" 0 = a , 1=b,", {0: "a", 1: "b"}),
    ],
)
def test_parse_device_workers(spec: str, expected: dict[int, str]) -> None:
    assert parse_device_workers(spec) == expected


@pytest.mark.parametrize("spec", ["0", "x=a", "0=", "-1=a"])
def test_parse_device_workers_rejects(spec: str) -> None:
    with pytest.raises(ValueError, match="DEVICE=WORKER"):
        parse_device_workers(spec)
