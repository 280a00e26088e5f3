"""Pure parsers over the text `npu-smi` prints: no I/O, no subprocesses (docs/npu-telemetry.md).

`npu-smi info` prints a box table, two rows per NPU, whose spacing differs between driver
versions (a five-digit value can touch the slash of `used / total`). So rows are split into cells on
`|`, the cells of the header rows give each column's meaning, and the values of a data row are
matched to those names: by position when the counts agree, else by the nearest header offset (a
blank cell leaves its field `None`). Anything that does not parse becomes `None`, never an error:
callers decide whether an empty result is a failure.

`npu-smi info -t usages|common|power|temp -i N` prints `Key : value` lines; `parse_key_values`
reads them and `readings_from_key_values` picks the numbers we export.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Literal

# Values: a run without spaces or slashes, optionally `/ other` pairs with any spacing around `/`.
_VALUE_TOKEN = re.compile(r"[^\s/]+(?:\s*/\s*[^\s/]+)*")
_HEADER_WORD = re.compile(r"\S+")
_SEPARATOR = re.compile(r"^\+[-=+]*$")
_VERSION = re.compile(r"npu-smi\s+(\S+)", re.IGNORECASE)
_BUS_ID = re.compile(r"[0-9a-fA-F]+:[0-9a-fA-F]+")

RowKind = Literal["npu", "chip", "process"]


@dataclass(frozen=True, slots=True)
class NpuProcess:
    """One row of the process table under `npu-smi info`."""

    npu_id: int
    chip_id: int | None
    pid: int
    name: str | None
    memory_mb: float | None


@dataclass(frozen=True, slots=True)
class NpuChip:
    """One chip of one NPU as `npu-smi info` shows it; `None` where the table had no value."""

    npu_id: int
    chip_id: int | None = None
    device_id: int | None = None
    name: str | None = None
    health: str | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    aicore_percent: float | None = None
    memory_used_mb: float | None = None
    memory_total_mb: float | None = None
    hbm_used_mb: float | None = None
    hbm_total_mb: float | None = None
    bus_id: str | None = None
    processes: tuple[NpuProcess, ...] = ()

    @property
    def device(self) -> int:
        """The logical device id: the `Device` column where npu-smi prints one (310P), else NPU."""
        return self.npu_id if self.device_id is None else self.device_id

    @property
    def healthy(self) -> bool | None:
        """Only `OK` is healthy; Warning, Alarm, Critical and unknown words are not."""
        return None if self.health is None else self.health.upper() == "OK"


@dataclass(frozen=True, slots=True)
class ChipReadings:
    """The numbers of one `npu-smi info -t ...` output that we export."""

    aicore_percent: float | None = None
    hbm_capacity_mb: float | None = None
    hbm_usage_percent: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    npu_utilization_percent: float | None = None

    @property
    def hbm_used_mb(self) -> float | None:
        """`usages` gives only a rate: used = capacity x rate (whole percents, so approximate)."""
        if self.hbm_capacity_mb is None or self.hbm_usage_percent is None:
            return None
        return self.hbm_capacity_mb * self.hbm_usage_percent / 100.0


@dataclass(frozen=True, slots=True)
class _Column:
    key: str
    offset: int


@dataclass(frozen=True, slots=True)
class _Headers:
    npu: tuple[tuple[_Column, ...], ...] = ()
    chip: tuple[tuple[_Column, ...], ...] = ()
    process: tuple[tuple[_Column, ...], ...] = ()


# ---------------------------------------------------------------------------------------------
# Numbers


def to_float(text: str | None) -> float | None:
    """A finite number, or `None` for `NA`, `-`, blanks and anything else."""
    if text is None:
        return None
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def to_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def split_pair(text: str | None) -> tuple[float | None, float | None]:
    """`3445 / 65536`, `12345/ 65536` or `3378 /65536` -> (used, total)."""
    if text is None:
        return None, None
    used, slash, total = text.partition("/")
    return to_float(used), to_float(total) if slash else None


def parse_version(text: str) -> str | None:
    """The `npu-smi X.Y.Z` version from the title row of `npu-smi info`."""
    match = _VERSION.search(text)
    return match.group(1) if match else None


# ---------------------------------------------------------------------------------------------
# Key-value outputs: `npu-smi info -t usages|common|power|temp -i N`


def parse_key_values(text: str) -> dict[str, str]:
    """`Key : value` lines (any indentation, tabs or spaces) -> {key: value}.

    The first occurrence of a key wins: `-t common` repeats `Temperature(C)` for the MCU block
    after the chip's own (docs/npu-telemetry.md). Keys keep their words, whitespace collapsed.
    """
    result: dict[str, str] = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        key = " ".join(key.split())
        if colon and key and key not in result:
            result[key] = value.strip()
    return result


_READING_KEYS: Mapping[str, tuple[str, ...]] = {
    "aicore_percent": ("aicoreusagerate(%)",),
    "hbm_capacity_mb": ("hbmcapacity(mb)",),
    "hbm_usage_percent": ("hbmusagerate(%)",),
    "power_w": ("npureal-timepower(w)", "power(w)", "powerdissipation(w)"),
    "temperature_c": ("temperature(c)", "nputemperature(c)", "chiptemperature(c)"),
    "npu_utilization_percent": ("npuutilization(%)",),
}


def _normalise_key(key: str) -> str:
    return "".join(key.split()).lower()


def readings_from_key_values(values: Mapping[str, str]) -> ChipReadings:
    """The numbers in one `-t usages|common|power|temp` output; absent or `NA` ones are `None`."""
    by_key: dict[str, str] = {}
    for key, value in values.items():
        by_key.setdefault(_normalise_key(key), value)
    found = {
        field: next((to_float(by_key[k]) for k in keys if k in by_key), None)
        for field, keys in _READING_KEYS.items()
    }
    return ChipReadings(**found)


def apply_readings(chip: NpuChip, readings: ChipReadings) -> NpuChip:
    """Fills the chip's missing values from `-t` readings; values from the table are kept."""
    return replace(
        chip,
        aicore_percent=_first(chip.aicore_percent, readings.aicore_percent),
        hbm_used_mb=_first(chip.hbm_used_mb, readings.hbm_used_mb),
        hbm_total_mb=_first(chip.hbm_total_mb, readings.hbm_capacity_mb),
        power_w=_first(chip.power_w, readings.power_w),
        temperature_c=_first(chip.temperature_c, readings.temperature_c),
    )


def _first(value: float | None, fallback: float | None) -> float | None:
    return fallback if value is None else value


# ---------------------------------------------------------------------------------------------
# The `npu-smi info` table


def parse_info(text: str) -> list[NpuChip]:
    """The chips of `npu-smi info`, with their processes; `[]` when no table is recognised."""
    rows = list(_classified_rows(text))
    processes = [p for kind, row in rows if kind == "process" for p in _processes(row)]
    return [_with_processes(chip, processes) for chip in _chips(rows)]


def _classified_rows(text: str) -> Iterator[tuple[RowKind, dict[str, str]]]:
    """Data rows of the table as {column key: value}, each with the header it was read by."""
    headers = _Headers()
    previous: RowKind | None = None
    for line in text.expandtabs(8).splitlines():
        stripped = line.strip()
        if _SEPARATOR.match(stripped):
            previous = None
            continue
        if not stripped.startswith("|"):
            continue
        cells = _cells(stripped)
        new_headers = _read_header(headers, cells)
        if new_headers is not None:
            headers, previous = new_headers, None
            continue
        classified = _classify(headers, cells, previous)
        if classified is not None:
            previous = classified[0]
            yield classified


def _cells(row: str) -> list[str]:
    return row.strip("|").split("|")


def _read_header(headers: _Headers, cells: list[str]) -> _Headers | None:
    keys = [_normalise_key(cell) for cell in cells]
    if any("processid" in key for key in keys):
        return replace(headers, process=_header_columns(cells))
    if any("health" in key for key in keys):
        return replace(headers, npu=_header_columns(cells))
    if any("bus-id" in key for key in keys):
        return replace(headers, chip=_header_columns(cells))
    return None


def _header_columns(cells: list[str]) -> tuple[tuple[_Column, ...], ...]:
    return tuple(tuple(_header_names(cell)) for cell in cells)


def _header_names(cell: str) -> list[_Column]:
    """Header words -> column names; `Temp (C)` and `Process id` stay one name each."""
    columns: list[_Column] = []
    for match in _HEADER_WORD.finditer(cell):
        word = _normalise_key(match.group())
        if columns and (word.startswith("(") or columns[-1].key == "process"):
            columns[-1] = _Column(columns[-1].key + word, columns[-1].offset)
        else:
            columns.append(_Column(word, match.start()))
    return columns


def _classify(
    headers: _Headers, cells: list[str], previous: RowKind | None
) -> tuple[RowKind, dict[str, str]] | None:
    if headers.process:
        return "process", _row_values(headers.process, cells)
    if not headers.npu or not headers.chip:
        return None
    as_chip = _row_values(headers.chip, cells)
    if previous == "npu" or _BUS_ID.search(as_chip.get("bus-id", "")):
        return "chip", as_chip
    return "npu", _row_values(headers.npu, cells)


def _row_values(headers: tuple[tuple[_Column, ...], ...], cells: list[str]) -> dict[str, str]:
    values: dict[str, str] = {}
    for columns, cell in zip(headers, cells, strict=False):
        values.update(_cell_values(columns, cell))
    return values


def _cell_values(columns: tuple[_Column, ...], cell: str) -> dict[str, str]:
    tokens = [(m.group(), m.start()) for m in _VALUE_TOKEN.finditer(cell)]
    if not columns or not tokens:
        return {}
    if len(tokens) >= len(columns):
        head = {column.key: text for column, (text, _) in zip(columns[:-1], tokens, strict=False)}
        rest = " ".join(text for text, _ in tokens[len(columns) - 1 :])
        return {**head, columns[-1].key: rest}
    return dict(_nearest_columns(columns, tokens))


def _nearest_columns(
    columns: tuple[_Column, ...], tokens: list[tuple[str, int]]
) -> Iterator[tuple[str, str]]:
    """Fewer values than columns: each value goes to the nearest column right of the last one."""
    start = 0
    for index, (text, offset) in enumerate(tokens):
        # Leave room for the values still to place, so every value gets a column.
        candidates = range(start, len(columns) - (len(tokens) - index - 1))
        best = min(candidates, key=lambda i: abs(columns[i].offset - offset))
        yield columns[best].key, text
        start = best + 1


def _chips(rows: Iterable[tuple[RowKind, dict[str, str]]]) -> Iterator[NpuChip]:
    """Pairs each NPU row with the chip rows under it; an NPU row alone is still one chip."""
    npu: NpuChip | None = None
    emitted = True
    for kind, values in rows:
        if kind == "npu":
            if npu is not None and not emitted:
                yield npu
            npu, emitted = _npu_row(values), False
        elif kind == "chip" and npu is not None:
            yield _chip_row(npu, values)
            emitted = True
    if npu is not None and not emitted:
        yield npu


def _npu_row(values: dict[str, str]) -> NpuChip | None:
    npu_id = to_int(values.get("npu"))
    if npu_id is None:
        return None
    return NpuChip(
        npu_id=npu_id,
        name=values.get("name"),
        health=values.get("health"),
        power_w=to_float(values.get("power(w)")),
        temperature_c=to_float(values.get("temp(c)")),
    )


def _chip_row(npu: NpuChip, values: dict[str, str]) -> NpuChip:
    memory_used, memory_total = split_pair(values.get("memory-usage(mb)"))
    hbm_used, hbm_total = split_pair(values.get("hbm-usage(mb)"))
    return replace(
        npu,
        chip_id=to_int(values.get("chip")),
        device_id=to_int(values.get("device")),
        bus_id=values.get("bus-id"),
        aicore_percent=to_float(values.get("aicore(%)")),
        memory_used_mb=memory_used,
        memory_total_mb=memory_total,
        hbm_used_mb=hbm_used,
        hbm_total_mb=hbm_total,
    )


def _processes(values: dict[str, str]) -> Iterator[NpuProcess]:
    npu_id, pid = to_int(values.get("npu")), to_int(values.get("processid"))
    if npu_id is not None and pid is not None:
        yield NpuProcess(
            npu_id=npu_id,
            chip_id=to_int(values.get("chip")),
            pid=pid,
            name=values.get("processname"),
            memory_mb=to_float(values.get("processmemory(mb)")),
        )


def _with_processes(chip: NpuChip, processes: list[NpuProcess]) -> NpuChip:
    mine = tuple(
        p for p in processes if p.npu_id == chip.npu_id and p.chip_id in (chip.chip_id, None)
    )
    return replace(chip, processes=mine) if mine else chip
