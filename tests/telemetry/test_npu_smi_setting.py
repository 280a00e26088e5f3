"""The gateway's NPU settings (issue 15): `npu_smi` auto finds npu-smi where the driver put it and
is silent where there is none; `npu_exporter_names` switches Ascend's names off; a mount that left
a directory where npu-smi should be says so."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from mineru_gateway.api.app import build_telemetry
from mineru_gateway.config import GatewaySettings
from mineru_gateway.telemetry import NpuSmiNotFound, NpuSmiSource, find_npu_smi, source
from tests.conftest import StartGateway, StartSim
from tests.support.npu_smi_stub import install_npu_smi
from tests.support.servers import wait_for_series


@pytest.fixture
def no_npu_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A machine without npu-smi: an empty PATH entry and no driver locations."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(source, "NPU_SMI_LOCATIONS", (str(tmp_path / "usr/local/bin/npu-smi"),))
    return tmp_path


def test_the_default_is_auto() -> None:
    assert GatewaySettings().npu_smi == "auto"
    assert GatewaySettings().npu_exporter_names is True


def test_auto_without_npu_smi_means_no_telemetry(no_npu_smi: Path) -> None:
    assert find_npu_smi("auto") is None
    assert build_telemetry(GatewaySettings(npu_smi="auto")) is None
    assert find_npu_smi("off") is None


def test_auto_finds_npu_smi_on_path_first(
    no_npu_smi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = install_npu_smi(no_npu_smi / "bin")
    monkeypatch.setenv("PATH", str(stub.directory))
    assert find_npu_smi("auto") == str(stub.path)
    assert build_telemetry(GatewaySettings(npu_smi="auto")) is not None


def test_auto_falls_back_to_where_drivers_install_it(
    no_npu_smi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = install_npu_smi(no_npu_smi / "sbin")
    locations = (str(no_npu_smi / "missing/npu-smi"), str(stub.path))
    monkeypatch.setattr(source, "NPU_SMI_LOCATIONS", locations)
    assert find_npu_smi("auto") == str(stub.path)


def test_an_explicit_path_is_kept_even_when_missing(no_npu_smi: Path) -> None:
    # An npu-smi that was asked for and cannot run is reported (npu_smi_up 0), not hidden.
    assert find_npu_smi("/opt/missing/npu-smi") == "/opt/missing/npu-smi"
    assert build_telemetry(GatewaySettings(npu_smi="/opt/missing/npu-smi")) is not None


async def test_a_directory_where_npu_smi_should_be_is_named(tmp_path: Path) -> None:
    mounted = tmp_path / "npu-smi"
    mounted.mkdir()  # what Docker leaves for a bind mount of a missing host file
    with pytest.raises(NpuSmiNotFound, match="is a directory, not npu-smi"):
        await NpuSmiSource(str(mounted)).read()


def test_auto_on_an_npu_host_exports_the_npus(
    no_npu_smi: Path,
    monkeypatch: pytest.MonkeyPatch,
    start_sim: StartSim,
    start_gateway: StartGateway,
) -> None:
    stub = install_npu_smi(no_npu_smi / "bin")
    monkeypatch.setenv("PATH", str(stub.directory))
    gateway = start_gateway([start_sim(model_name="m")], npu_smi_interval_s=0.1)
    assert "npu_chip_info_power{" in wait_for_series(gateway, "mineru_gateway_npu_power_watts")


def test_ascends_names_can_be_switched_off(
    tmp_path: Path, start_sim: StartSim, start_gateway: StartGateway
) -> None:
    stub = install_npu_smi(tmp_path / "bin")
    gateway = start_gateway(
        [start_sim(model_name="m")],
        npu_smi=str(stub.path),
        npu_smi_interval_s=0.1,
        npu_exporter_names=False,
    )
    wait_for_series(gateway, "mineru_gateway_npu_power_watts")
    assert "npu_chip_info" not in httpx.get(gateway + "/metrics").text
