from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from mineru_gateway.telemetry.source import (
    NpuSmiExitError,
    NpuSmiNotFound,
    NpuSmiParseError,
    NpuSmiSource,
    NpuSmiTimeout,
)
from tests.support.npu_smi_stub import (
    NpuSmiStub,
    eventually,
    fixture,
    install_npu_smi,
    path_with,
    process_alive,
)
from tests.telemetry import tables

pytestmark = pytest.mark.unit


@pytest.fixture
def stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NpuSmiStub:
    """The recorded npu-smi, first on PATH."""
    installed = install_npu_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", path_with(installed.directory))
    return installed


def duo_responses() -> dict[str, str]:
    usages, power = fixture("usages_910B_v23.0.rc2.txt"), fixture("power_v25.5.1.txt")
    return {
        "info": tables.DUO_310P,
        "info -t usages -i 8 -c 0": usages,
        "info -t usages -i 8 -c 1": usages,
        "info -t usages -i 9": usages,
        "info -t power -i 8 -c 0": power,
        # No answer for `-t power -i 8 -c 1`: the stub exits 2.
    }


async def test_reads_the_recorded_table_with_one_run(stub: NpuSmiStub) -> None:
    snapshot = await NpuSmiSource().read()
    assert [chip.npu_id for chip in snapshot.chips] == list(range(8))
    assert snapshot.chips[5].power_w == 102.4
    assert (snapshot.version, snapshot.detail_errors) == ("25.2.0", ())
    assert stub.calls() == ["info"]  # every value was in the table: no -t queries


async def test_output_is_capped(stub: NpuSmiStub) -> None:
    stub.configure({"info": fixture("info_910B3_x8_idle.txt") + "x" * (6 * 1024 * 1024)})
    snapshot = await NpuSmiSource().read()
    assert len(snapshot.chips) == 8  # the table came first; the flood was cut at 4 MiB


async def test_missing_values_are_asked_per_chip(stub: NpuSmiStub) -> None:
    stub.configure(duo_responses())
    snapshot = await NpuSmiSource().read()
    first, second, third = snapshot.chips
    assert first.hbm_total_mb == 65536.0
    assert first.hbm_used_mb == pytest.approx(2621.44)
    assert (first.power_w, second.power_w, third.power_w) == (103.5, None, 63.0)
    assert snapshot.detail_errors == ("exit_code",)
    assert stub.calls() == [
        "info",
        "info -t usages -i 8 -c 0",
        "info -t power -i 8 -c 0",
        "info -t usages -i 8 -c 1",
        "info -t power -i 8 -c 1",
        "info -t usages -i 9",
    ]


async def test_missing_temperature_is_asked_with_temp(stub: NpuSmiStub) -> None:
    blank_temp = tables.OLD_910A.replace("36 ", "   ")
    stub.configure({"info": blank_temp, "info -t temp -i 0": fixture("temp_v25.5.1.txt")})
    snapshot = await NpuSmiSource().read()
    assert snapshot.chips[0].temperature_c == 39.0
    assert "info -t temp -i 0" in stub.calls()


async def test_fill_missing_can_be_turned_off(stub: NpuSmiStub) -> None:
    stub.configure(duo_responses())
    snapshot = await NpuSmiSource(fill_missing=False).read()
    assert snapshot.chips[0].hbm_total_mb is None
    assert stub.calls() == ["info"]


async def test_configured_path_wins_over_path(tmp_path: Path, stub: NpuSmiStub) -> None:
    other = install_npu_smi(tmp_path / "other", {"info": tables.BUSY_910B})
    snapshot = await NpuSmiSource(str(other.path)).read()
    assert snapshot.version == "24.1.rc2"
    assert (stub.calls(), other.calls()) == ([], ["info"])


async def test_absent_npu_smi_is_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NpuSmiNotFound):
        await NpuSmiSource().read()
    with pytest.raises(NpuSmiNotFound):
        await NpuSmiSource(str(tmp_path / "missing" / "npu-smi")).read()


async def test_not_executable_is_not_found(stub: NpuSmiStub) -> None:
    stub.path.chmod(0o644)
    with pytest.raises(NpuSmiNotFound):
        await NpuSmiSource(str(stub.path)).read()


async def test_unrunnable_file_is_not_found(tmp_path: Path) -> None:
    broken = tmp_path / "npu-smi"
    broken.write_bytes(b"\x7fELF not really")
    broken.chmod(0o755)
    with pytest.raises(NpuSmiNotFound, match="cannot run"):
        await NpuSmiSource(str(broken)).read()


async def test_exit_code_carries_stderr(stub: NpuSmiStub) -> None:
    stub.configure(exit_code=1, stderr="dcmi module initialize failed. ret is -8005\n")
    with pytest.raises(NpuSmiExitError, match="ret is -8005") as caught:
        await NpuSmiSource().read()
    assert caught.value.returncode == 1


@pytest.mark.parametrize("garbage", tables.GARBAGE)
async def test_garbage_is_a_parse_error(stub: NpuSmiStub, garbage: str) -> None:
    stub.configure({"info": garbage})
    with pytest.raises(NpuSmiParseError):
        await NpuSmiSource().read()


async def test_timeout_kills_npu_smi_and_its_children(stub: NpuSmiStub) -> None:
    stub.configure(hang=True)
    started = time.monotonic()
    with pytest.raises(NpuSmiTimeout):
        await NpuSmiSource(timeout_s=1.0).read()
    assert time.monotonic() - started < 5.0
    pids = stub.hung_pids()
    assert len(pids) == 2  # the stub and its grandchild `sleep`, which holds the pipes too
    await eventually(lambda: not any(process_alive(pid) for pid in pids), timeout_s=2.0)


async def test_cancelled_read_kills_npu_smi(stub: NpuSmiStub) -> None:
    stub.configure(hang=True)
    task = asyncio.create_task(NpuSmiSource(timeout_s=60.0).read())
    await eventually(lambda: len(stub.hung_pids()) == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: not any(process_alive(pid) for pid in stub.hung_pids()), 2.0)
