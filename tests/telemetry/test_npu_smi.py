from __future__ import annotations

import pytest

from mineru_gateway.telemetry.npu_smi import (
    ChipReadings,
    NpuChip,
    NpuProcess,
    apply_readings,
    parse_info,
    parse_key_values,
    parse_version,
    readings_from_key_values,
    split_pair,
    to_float,
    to_int,
)
from tests.support.npu_smi_stub import fixture
from tests.telemetry import tables

pytestmark = pytest.mark.unit

INFO = fixture("info_910B3_x8_idle.txt")

# (npu, power W, temp C, HBM used MB, bus id) as recorded in info_910B3_x8_idle.txt
RECORDED = [
    (0, 98.2, 41.0, 3445.0, "0000:C1:00.0"),
    (1, 96.8, 41.0, 3418.0, "0000:C2:00.0"),
    (2, 94.2, 41.0, 3416.0, "0000:81:00.0"),
    (3, 99.9, 42.0, 3417.0, "0000:82:00.0"),
    (4, 92.3, 45.0, 3417.0, "0000:01:00.0"),
    (5, 102.4, 46.0, 3433.0, "0000:02:00.0"),
    (6, 101.6, 45.0, 3415.0, "0000:41:00.0"),
    (7, 98.8, 47.0, 3411.0, "0000:42:00.0"),
]


def test_recorded_info_gives_eight_idle_910b3() -> None:
    chips = parse_info(INFO)
    assert [(c.npu_id, c.power_w, c.temperature_c, c.hbm_used_mb, c.bus_id) for c in chips] == (
        RECORDED
    )
    for chip in chips:
        assert (chip.chip_id, chip.name, chip.health, chip.healthy) == (0, "910B3", "OK", True)
        assert (chip.aicore_percent, chip.hbm_total_mb) == (0.0, 65536.0)
        assert (chip.memory_used_mb, chip.memory_total_mb) == (0.0, 0.0)
        assert chip.processes == ()
        assert chip.device == chip.npu_id


def test_recorded_version() -> None:
    assert parse_version(INFO) == "25.2.0"
    assert parse_version("garbage") is None


def _respaced(text: str) -> str:
    """Indented lines, tabs for runs of spaces, Windows line ends."""
    return "\r\n".join("    " + line.replace("     ", "\t") for line in text.splitlines())


def test_tabs_indentation_and_crlf_change_nothing() -> None:
    assert parse_info(_respaced(INFO)) == parse_info(INFO)


def test_five_digit_values_touching_the_slash() -> None:
    busy, warning = parse_info(tables.BUSY_910B)
    assert (busy.hbm_used_mb, busy.hbm_total_mb, busy.aicore_percent) == (61234.0, 65536.0, 87.0)
    assert (warning.hbm_used_mb, warning.hbm_total_mb) == (3378.0, 65536.0)
    assert (busy.power_w, busy.temperature_c) == (312.5, 58.0)


def test_warning_health_is_not_healthy() -> None:
    busy, warning = parse_info(tables.BUSY_910B)
    assert (busy.health, busy.healthy) == ("OK", True)
    assert (warning.health, warning.healthy) == ("Warning", False)


def test_process_table_is_attached_to_its_chip() -> None:
    busy, warning = parse_info(tables.BUSY_910B)
    assert busy.processes == (
        NpuProcess(npu_id=0, chip_id=0, pid=2871054, name="python3.11", memory_mb=57800.0),
        NpuProcess(npu_id=0, chip_id=0, pid=2871099, name="VLLMWorker", memory_mb=120.0),
    )
    assert warning.processes == ()


def test_310p_layout_with_device_column_and_no_hbm() -> None:
    chips = parse_info(tables.DUO_310P)
    assert [(c.npu_id, c.chip_id, c.device) for c in chips] == [(8, 0, 0), (8, 1, 1), (9, 0, 2)]
    first, second, third = chips
    assert first.power_w is None  # NA
    assert (first.temperature_c, second.aicore_percent) == (45.0, 12.0)
    assert (first.memory_used_mb, first.memory_total_mb) == (1703.0, 21527.0)
    assert (first.hbm_used_mb, first.hbm_total_mb) == (None, None)
    assert (third.health, third.healthy, third.power_w) == ("Critical", False, 63.0)


def test_old_910a_layout_with_blank_cells() -> None:
    ok, alarm = parse_info(tables.OLD_910A)
    assert (ok.power_w, ok.temperature_c, ok.name) == (68.5, 36.0, "910A")
    assert (ok.memory_used_mb, ok.memory_total_mb) == (2375.0, 15307.0)
    assert (ok.hbm_used_mb, ok.hbm_total_mb) == (None, None)
    assert (alarm.power_w, alarm.temperature_c, alarm.healthy) == (None, 37.0, False)
    assert (alarm.hbm_used_mb, alarm.hbm_total_mb, alarm.aicore_percent) == (12345.0, 32768.0, 5.0)


def test_spaced_unit_unknown_health_and_npu_without_chip_row() -> None:
    lonely, paired = parse_info(tables.ODD_HEADERS)
    assert lonely == NpuChip(
        npu_id=0, name="910B4", health="UNKNOWN_42", power_w=80.0, temperature_c=40.0
    )
    assert lonely.healthy is False
    assert (paired.chip_id, paired.temperature_c, paired.hbm_total_mb) == (0, 41.0, 32768.0)


def test_rows_without_separators_are_told_apart_by_bus_id() -> None:
    chips = parse_info(tables.NO_SEPARATORS)
    assert [(c.npu_id, c.bus_id, c.aicore_percent) for c in chips] == [
        (0, "0000:C1:00.0", 0.0),
        (1, "0000:C2:00.0", 7.0),
    ]


def test_missing_health_means_unknown() -> None:
    text = tables.ODD_HEADERS.replace("UNKNOWN_42", "          ")
    assert parse_info(text)[0].healthy is None


def test_npu_row_without_id_is_dropped_with_its_chip_rows() -> None:
    text = tables.BUSY_910B.replace("| 0     910B3 ", "| ?     910B3 ")
    assert [chip.npu_id for chip in parse_info(text)] == [1]


def test_blank_header_cells_are_ignored() -> None:
    text = (
        "| NPU Name | Health |      | Power(W) |\n"
        "| Chip     | Bus-Id |      | HBM-Usage(MB) |\n"
        "| 3  910B  | OK     | junk | 90.5 |\n"
        "| 0        | 0000:01:00.0 | junk | 10 / 20 |\n"
    )
    [chip] = parse_info(text)
    assert (chip.npu_id, chip.power_w, chip.hbm_used_mb, chip.hbm_total_mb) == (3, 90.5, 10, 20)


@pytest.mark.parametrize("text", tables.GARBAGE)
def test_garbage_gives_no_chips(text: str) -> None:
    assert parse_info(text) == []


def test_truncated_table_keeps_complete_npus() -> None:
    lines = INFO.splitlines()
    chips = parse_info("\n".join(lines[:10]))  # header + NPU 0 pair + NPU 1's first row
    assert [(c.npu_id, c.chip_id, c.hbm_used_mb) for c in chips] == [
        (0, 0, 3445.0),
        (1, None, None),
    ]


# ---------------------------------------------------------------------------------------------
# -t outputs


def test_key_values_of_recorded_usages() -> None:
    values = parse_key_values(fixture("usages_910B_v23.0.rc2.txt"))
    assert values["HBM Capacity(MB)"] == "65536"
    assert values["HBM Usage Rate(%)"] == "4"
    assert values["Chip ID"] == "0"
    assert len(values) == 15


def test_key_values_first_occurrence_wins_and_values_keep_colons() -> None:
    text = (
        "\tTemperature(C) : 46\n  Temperature(C)  :  38\nPCIe Bus Info : 0000:C1:00.0\nno colon\n"
    )
    assert parse_key_values(text) == {"Temperature(C)": "46", "PCIe Bus Info": "0000:C1:00.0"}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "usages_910B_v23.0.rc2.txt",
            ChipReadings(aicore_percent=0.0, hbm_capacity_mb=65536.0, hbm_usage_percent=4.0),
        ),
        (
            "common_910B.txt",
            ChipReadings(
                aicore_percent=0.0, hbm_usage_percent=4.0, power_w=93.4, temperature_c=46.0
            ),
        ),
        ("power_v25.5.1.txt", ChipReadings(power_w=103.5)),
        ("temp_v25.5.1.txt", ChipReadings(temperature_c=39.0)),
    ],
)
def test_readings_of_recorded_outputs(name: str, expected: ChipReadings) -> None:
    assert readings_from_key_values(parse_key_values(fixture(name))) == expected


def test_hbm_used_is_capacity_times_rate() -> None:
    readings = readings_from_key_values(parse_key_values(fixture("usages_910B_v23.0.rc2.txt")))
    assert readings.hbm_used_mb == pytest.approx(2621.44)
    assert ChipReadings(hbm_usage_percent=4.0).hbm_used_mb is None


def test_newer_usages_with_tabs_and_npu_utilization() -> None:
    readings = readings_from_key_values(parse_key_values(tables.USAGES_NEWER))
    assert readings == ChipReadings(
        aicore_percent=91.0,
        hbm_capacity_mb=65536.0,
        hbm_usage_percent=50.0,
        npu_utilization_percent=93.0,
    )


def test_na_readings_are_none() -> None:
    text = "NPU Real-time Power(W) : NA\nTemperature(C) : -\n"
    assert readings_from_key_values(parse_key_values(text)) == ChipReadings()


def test_readings_fill_only_missing_values() -> None:
    chip = NpuChip(npu_id=8, power_w=None, temperature_c=45.0, aicore_percent=3.0)
    readings = ChipReadings(
        aicore_percent=50.0,
        hbm_capacity_mb=1000.0,
        hbm_usage_percent=10.0,
        power_w=70.0,
        temperature_c=99.0,
    )
    filled = apply_readings(chip, readings)
    assert (filled.power_w, filled.temperature_c, filled.aicore_percent) == (70.0, 45.0, 3.0)
    assert (filled.hbm_used_mb, filled.hbm_total_mb) == (100.0, 1000.0)


# ---------------------------------------------------------------------------------------------
# Converters


@pytest.mark.parametrize(
    ("text", "expected"),
    [("98.2", 98.2), (" 41 ", 41.0), ("NA", None), ("-", None), ("nan", None), ("", None)],
)
def test_to_float(text: str, expected: float | None) -> None:
    assert to_float(text) == expected


def test_to_float_and_int_of_none() -> None:
    assert (to_float(None), to_int(None), to_int("x"), to_int(" 7")) == (None, None, None, 7)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3445 / 65536", (3445.0, 65536.0)),
        ("12345/ 65536", (12345.0, 65536.0)),
        ("3378 /65536", (3378.0, 65536.0)),
        ("3378/NA", (3378.0, None)),
        ("17", (17.0, None)),
        (None, (None, None)),
    ],
)
def test_split_pair(text: str | None, expected: tuple[float | None, float | None]) -> None:
    assert split_pair(text) == expected
