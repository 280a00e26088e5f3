from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import DuplicateTimeseries

from mineru_gateway.telemetry.collector import (
    MIB,
    NpuMetricsCollector,
    NpuTelemetry,
    register_npu_metrics,
)
from mineru_gateway.telemetry.source import NpuSmiSource
from tests.support.npu_smi_stub import (
    NpuSmiStub,
    eventually,
    install_npu_smi,
    path_with,
    process_alive,
)
from tests.telemetry import tables
from tests.telemetry.test_npu_smi import RECORDED

WORKERS = {0: "http://127.0.0.1:30001", 5: "http://127.0.0.1:30006"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NpuSmiStub:
    installed = install_npu_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", path_with(installed.directory))
    return installed


def make_telemetry(timeout_s: float = 10.0) -> NpuTelemetry:
    source = NpuSmiSource(timeout_s=timeout_s)
    return NpuTelemetry(source, interval_s=0.05, device_workers=WORKERS)


def exposition(telemetry: NpuTelemetry, *, npu_exporter_names: bool = True) -> str:
    registry = CollectorRegistry()
    register_npu_metrics(registry, telemetry, npu_exporter_names=npu_exporter_names)
    return generate_latest(registry).decode()


def samples(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def names(text: str) -> set[str]:
    return {name for name, _ in samples(text)}


def labels(**values: str) -> frozenset[tuple[str, str]]:
    return frozenset(values.items())


def own(npu: int, worker: str = "") -> frozenset[tuple[str, str]]:
    return labels(npu=str(npu), chip="0", worker=worker)


def compat(npu: int, bus_id: str) -> frozenset[tuple[str, str]]:
    return labels(id=str(npu), model_name="910B3", pcie_bus_info=bus_id)


async def test_exports_every_recorded_value(stub: NpuSmiStub) -> None:
    telemetry = make_telemetry()
    await telemetry.refresh()
    got = samples(exposition(telemetry))
    for npu, power, temp, hbm_used, bus_id in RECORDED:
        worker = WORKERS.get(npu, "")
        assert got["mineru_gateway_npu_power_watts", own(npu, worker)] == power
        assert got["mineru_gateway_npu_temperature_celsius", own(npu, worker)] == temp
        assert got["mineru_gateway_npu_hbm_used_bytes", own(npu, worker)] == hbm_used * MIB
        assert got["mineru_gateway_npu_hbm_total_bytes", own(npu, worker)] == 65536 * MIB
        assert got["mineru_gateway_npu_aicore_utilization_ratio", own(npu, worker)] == 0.0
        assert got["mineru_gateway_npu_healthy", own(npu, worker)] == 1.0
        assert got["npu_chip_info_power", compat(npu, bus_id)] == power
        assert got["npu_chip_info_temperature", compat(npu, bus_id)] == temp
        assert got["npu_chip_info_hbm_used_memory", compat(npu, bus_id)] == hbm_used
        assert got["npu_chip_info_hbm_total_memory", compat(npu, bus_id)] == 65536.0
        assert got["npu_chip_info_utilization", compat(npu, bus_id)] == 0.0
        assert got["npu_chip_info_health_status", compat(npu, bus_id)] == 1.0


async def test_worker_info_series(stub: NpuSmiStub) -> None:
    telemetry = make_telemetry()
    await telemetry.refresh()
    got = samples(exposition(telemetry))
    info = labels(
        npu="5",
        chip="0",
        device="5",
        worker="http://127.0.0.1:30006",
        model_name="910B3",
        pcie_bus_info="0000:02:00.0",
    )
    assert got["mineru_gateway_npu_info", info] == 1.0
    assert sum(1 for name, _ in got if name == "mineru_gateway_npu_info") == 8


async def test_source_series_after_success(stub: NpuSmiStub) -> None:
    telemetry = NpuTelemetry(NpuSmiSource(), clock=lambda: 1700000000.5)
    state = await telemetry.refresh()
    got = samples(exposition(telemetry))
    assert got["mineru_gateway_npu_smi_up", labels()] == 1.0
    assert got["mineru_gateway_npu_smi_last_success_timestamp_seconds", labels()] == 1700000000.5
    assert got["mineru_gateway_npu_smi_scrape_duration_seconds", labels()] == pytest.approx(
        state.last_duration_s
    )
    for kind in ("not_found", "timeout", "exit_code", "parse"):
        assert got["mineru_gateway_npu_smi_errors_total", labels(kind=kind)] == 0.0


async def test_busy_and_warning_values(stub: NpuSmiStub) -> None:
    stub.configure({"info": tables.BUSY_910B})
    telemetry = make_telemetry()
    await telemetry.refresh()
    got = samples(exposition(telemetry))
    busy, warning = own(0, WORKERS[0]), own(1)
    assert got["mineru_gateway_npu_aicore_utilization_ratio", busy] == pytest.approx(0.87)
    assert got["mineru_gateway_npu_hbm_used_bytes", busy] == 61234 * MIB
    assert got["mineru_gateway_npu_healthy", warning] == 0.0
    assert got["npu_chip_info_health_status", compat(1, "0000:C2:00.0")] == 0.0


async def test_missing_values_have_no_series(stub: NpuSmiStub) -> None:
    stub.configure({"info": tables.OLD_910A})  # -t queries all fail: exit 2
    telemetry = make_telemetry()
    state = await telemetry.refresh()
    got = samples(exposition(telemetry))
    assert ("mineru_gateway_npu_power_watts", own(0, WORKERS[0])) in got
    assert ("mineru_gateway_npu_power_watts", own(1)) not in got
    assert ("mineru_gateway_npu_hbm_used_bytes", own(0, WORKERS[0])) not in got
    assert state.errors["exit_code"] == 2  # `-t usages -i 0` and `-t power -i 1` are unknown
    assert state.up


async def test_npu_exporter_names_can_be_switched_off(stub: NpuSmiStub) -> None:
    telemetry = make_telemetry()
    await telemetry.refresh()
    text = exposition(telemetry, npu_exporter_names=False)
    assert not any(name.startswith("npu_chip_info") for name in names(text))
    assert "mineru_gateway_npu_power_watts" in names(text)


async def test_absent_npu_smi_means_no_npu_series_and_counted_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    telemetry = make_telemetry()
    await telemetry.refresh()
    state = await telemetry.refresh()
    got = samples(exposition(telemetry))
    assert not any(
        name.startswith(("npu_chip_info", "mineru_gateway_npu_power")) for name, _ in got
    )
    assert got["mineru_gateway_npu_smi_errors_total", labels(kind="not_found")] == 2.0
    assert got["mineru_gateway_npu_smi_up", labels()] == 0.0
    assert got["mineru_gateway_npu_smi_last_success_timestamp_seconds", labels()] == 0.0
    assert state.snapshot is None


async def test_failure_after_success_drops_npu_series(stub: NpuSmiStub) -> None:
    telemetry = make_telemetry()
    first = await telemetry.refresh()
    stub.configure(exit_code=1)
    second = await telemetry.refresh()
    stub.configure({"info": "garbage"})
    third = await telemetry.refresh()
    got = samples(exposition(telemetry))
    assert not any(name.startswith("npu_chip_info") for name, _ in got)
    assert got["mineru_gateway_npu_smi_errors_total", labels(kind="exit_code")] == 1.0
    assert got["mineru_gateway_npu_smi_errors_total", labels(kind="parse")] == 1.0
    assert first.last_success_s == second.last_success_s == third.last_success_s
    stub.configure()
    assert (await telemetry.refresh()).up


async def test_timeout_is_counted_and_bounded(stub: NpuSmiStub) -> None:
    stub.configure(hang=True)
    telemetry = make_telemetry(timeout_s=0.5)
    started = time.monotonic()
    state = await telemetry.refresh()
    assert time.monotonic() - started < 5.0
    assert state.errors["timeout"] == 1
    await eventually(lambda: not any(process_alive(pid) for pid in stub.hung_pids()), 2.0)


async def test_loop_refreshes_until_stopped(stub: NpuSmiStub) -> None:
    telemetry = make_telemetry()
    await telemetry.start()
    await telemetry.start()  # idempotent
    await eventually(lambda: len(stub.calls()) >= 3)
    await telemetry.stop()
    calls = len(stub.calls())
    await asyncio.sleep(0.2)
    assert calls >= 3
    assert len(stub.calls()) == calls
    assert telemetry.state.up
    await telemetry.stop()  # idempotent


async def test_metrics_never_wait_for_a_hung_npu_smi(stub: NpuSmiStub) -> None:
    telemetry = make_telemetry()
    await telemetry.refresh()
    stub.configure(hang=True)
    telemetry = NpuTelemetry(NpuSmiSource(timeout_s=60.0), interval_s=0.05)
    await telemetry.start()
    await eventually(lambda: len(stub.hung_pids()) == 2)
    started = time.monotonic()
    text = exposition(telemetry)
    assert time.monotonic() - started < 0.5
    assert "mineru_gateway_npu_smi_up 0.0" in text
    await telemetry.stop()  # cancels the refresh: npu-smi is killed
    await eventually(lambda: not any(process_alive(pid) for pid in stub.hung_pids()), 2.0)


async def test_describe_names_every_family(stub: NpuSmiStub) -> None:
    telemetry = make_telemetry()
    await telemetry.refresh()
    collector = NpuMetricsCollector(telemetry)
    described = {family.name for family in collector.describe()}
    assert described == {family.name for family in collector.collect()}
    registry = CollectorRegistry()
    registry.register(collector)
    with pytest.raises(DuplicateTimeseries):
        register_npu_metrics(registry, make_telemetry())


async def test_promtool_accepts_the_exposition(stub: NpuSmiStub) -> None:
    telemetry = make_telemetry()
    await telemetry.refresh()
    result = await asyncio.to_thread(
        subprocess.run,
        ["promtool", "check", "metrics"],
        input=exposition(telemetry).encode(),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
