"""The periodic NPU reader, and the Prometheus collector that exports its last reading.

`NpuTelemetry` refreshes a cached snapshot every `interval_s` in an asyncio task; `/metrics` only
reads that cache (`NpuMetricsCollector.collect`), so a slow or hung `npu-smi` never delays a
scrape. A failed refresh drops the cached chips (no NPU series rather than stale ones) and counts
the failure by kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from mineru_gateway.periodic import Periodic
from mineru_gateway.telemetry.npu_smi import NpuChip
from mineru_gateway.telemetry.source import (
    ERROR_KINDS,
    ErrorKind,
    NpuSmiError,
    NpuSnapshot,
    NpuSource,
)

DEFAULT_INTERVAL_S = 5.0
MIB = 1024 * 1024  # npu-smi's "MB" are MiB: a 64 GiB HBM shows as 65536 MB

_log = structlog.get_logger(__name__)


def _zero_errors() -> Mapping[ErrorKind, int]:
    return MappingProxyType(dict.fromkeys(ERROR_KINDS, 0))


@dataclass(frozen=True, slots=True)
class TelemetryState:
    """What `/metrics` reads: replaced whole after each refresh, never changed in place."""

    snapshot: NpuSnapshot | None = None
    errors: Mapping[ErrorKind, int] = field(default_factory=_zero_errors)
    last_success_s: float | None = None
    last_duration_s: float | None = None
    up: bool = False

    def counted(self, kinds: Iterable[ErrorKind]) -> Mapping[ErrorKind, int]:
        errors = dict(self.errors)
        for kind in kinds:
            errors[kind] += 1
        return MappingProxyType(errors)


class NpuTelemetry:
    """Reads `source` every `interval_s` between `start()` and `stop()`; `state` is the last result.

    `device_workers` maps a device id (`NpuChip.device`: the NPU id, or the `Device` column where
    npu-smi prints one) to the worker using it, exported as the `worker` label.
    """

    def __init__(
        self,
        source: NpuSource,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        device_workers: Mapping[int, str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._source = source
        self._device_workers = MappingProxyType(dict(device_workers or {}))
        self._clock = clock
        self._state = TelemetryState()
        self._loop = Periodic("npu-telemetry", interval_s, self.refresh, immediately=True)

    @property
    def state(self) -> TelemetryState:
        return self._state

    def worker_for(self, chip: NpuChip) -> str:
        return self._device_workers.get(chip.device, "")

    async def refresh(self) -> TelemetryState:
        """Reads the source once; a failure is counted and logged, never raised."""
        started = time.perf_counter()
        try:
            snapshot = await self._source.read()
        except NpuSmiError as exc:
            self._failed(exc, time.perf_counter() - started)
        else:
            self._succeeded(snapshot, time.perf_counter() - started)
        return self._state

    async def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    def _succeeded(self, snapshot: NpuSnapshot, duration_s: float) -> None:
        if not self._state.up:
            _log.info("npu_smi_ok", chips=len(snapshot.chips), version=snapshot.version)
        self._state = TelemetryState(
            snapshot=snapshot,
            errors=self._state.counted(snapshot.detail_errors),
            last_success_s=self._clock(),
            last_duration_s=duration_s,
            up=True,
        )

    def _failed(self, exc: NpuSmiError, duration_s: float) -> None:
        if self._state.up or self._state.last_duration_s is None:  # log changes, not every beat
            _log.warning("npu_smi_failed", kind=exc.kind, error=str(exc))
        self._state = replace(
            self._state,
            snapshot=None,
            errors=self._state.counted([exc.kind]),
            last_duration_s=duration_s,
            up=False,
        )


# ---------------------------------------------------------------------------------------------
# Prometheus


@dataclass(frozen=True, slots=True)
class _ChipMetric:
    name: str
    documentation: str
    value: Callable[[NpuChip], float | None]


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _flag(value: bool | None) -> float | None:
    return None if value is None else float(value)


OWN_METRICS: tuple[_ChipMetric, ...] = (
    _ChipMetric(
        "mineru_gateway_npu_aicore_utilization_ratio",
        "AI-core utilisation of the chip, 0..1.",
        lambda chip: _scaled(chip.aicore_percent, 0.01),
    ),
    _ChipMetric(
        "mineru_gateway_npu_hbm_used_bytes",
        "HBM in use on the chip.",
        lambda chip: _scaled(chip.hbm_used_mb, MIB),
    ),
    _ChipMetric(
        "mineru_gateway_npu_hbm_total_bytes",
        "HBM capacity of the chip.",
        lambda chip: _scaled(chip.hbm_total_mb, MIB),
    ),
    _ChipMetric(
        "mineru_gateway_npu_power_watts", "Power draw of the NPU.", lambda chip: chip.power_w
    ),
    _ChipMetric(
        "mineru_gateway_npu_temperature_celsius",
        "Temperature of the chip.",
        lambda chip: chip.temperature_c,
    ),
    _ChipMetric(
        "mineru_gateway_npu_healthy",
        "1 when npu-smi reports the NPU's health as OK, else 0.",
        lambda chip: _flag(chip.healthy),
    ),
)

# Ascend npu-exporter's names and units (docs/npu-telemetry.md), so existing dashboards work.
NPU_EXPORTER_METRICS: tuple[_ChipMetric, ...] = (
    _ChipMetric(
        "npu_chip_info_utilization", "AI-core utilisation (%).", lambda chip: chip.aicore_percent
    ),
    _ChipMetric("npu_chip_info_hbm_used_memory", "HBM in use (MB).", lambda chip: chip.hbm_used_mb),
    _ChipMetric(
        "npu_chip_info_hbm_total_memory", "HBM capacity (MB).", lambda chip: chip.hbm_total_mb
    ),
    _ChipMetric("npu_chip_info_power", "Power draw (W).", lambda chip: chip.power_w),
    _ChipMetric("npu_chip_info_temperature", "Temperature (C).", lambda chip: chip.temperature_c),
    _ChipMetric(
        "npu_chip_info_health_status",
        "1 when the chip is healthy, else 0.",
        lambda chip: _flag(chip.healthy),
    ),
)

OWN_LABELS = ("npu", "chip", "worker")
NPU_EXPORTER_LABELS = ("id", "model_name", "pcie_bus_info")
INFO_LABELS = ("npu", "chip", "device", "worker", "model_name", "pcie_bus_info")


class NpuMetricsCollector(Collector):
    """Exports `telemetry.state` on `collect()`; reads the cache only, never runs npu-smi."""

    def __init__(self, telemetry: NpuTelemetry, *, npu_exporter_names: bool = True) -> None:
        self._telemetry = telemetry
        self._npu_exporter_names = npu_exporter_names

    def describe(self) -> Iterable[Metric]:
        return list(self._families(TelemetryState()))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(self._telemetry.state))

    def _families(self, state: TelemetryState) -> Iterator[Metric]:
        chips = state.snapshot.chips if state.snapshot is not None else ()
        yield from self._chip_families(OWN_METRICS, OWN_LABELS, chips, self._own_labels)
        if self._npu_exporter_names:
            yield from self._chip_families(
                NPU_EXPORTER_METRICS, NPU_EXPORTER_LABELS, chips, _npu_exporter_labels
            )
        yield self._info_family(chips)
        yield from _source_families(state)

    def _chip_families(
        self,
        metrics: Iterable[_ChipMetric],
        labels: tuple[str, ...],
        chips: Iterable[NpuChip],
        label_values: Callable[[NpuChip], list[str]],
    ) -> Iterator[Metric]:
        for metric in metrics:
            family = GaugeMetricFamily(metric.name, metric.documentation, labels=labels)
            for chip in chips:
                value = metric.value(chip)
                if value is not None:
                    family.add_metric(label_values(chip), value)
            yield family

    def _own_labels(self, chip: NpuChip) -> list[str]:
        return [str(chip.npu_id), _text(chip.chip_id), self._telemetry.worker_for(chip)]

    def _info_family(self, chips: Iterable[NpuChip]) -> Metric:
        family = GaugeMetricFamily(
            "mineru_gateway_npu_info",
            "Always 1: which worker uses each chip, its model and PCIe bus.",
            labels=INFO_LABELS,
        )
        for chip in chips:
            worker = self._telemetry.worker_for(chip)
            ids = [str(chip.npu_id), _text(chip.chip_id), str(chip.device), worker]
            family.add_metric([*ids, _text(chip.name), _text(chip.bus_id)], 1.0)
        return family


def _npu_exporter_labels(chip: NpuChip) -> list[str]:
    return [str(chip.device), _text(chip.name), _text(chip.bus_id)]


def _text(value: object) -> str:
    return "" if value is None else str(value)


def _source_families(state: TelemetryState) -> Iterator[Metric]:
    errors = CounterMetricFamily(
        "mineru_gateway_npu_smi_errors",
        "Failed npu-smi runs, by kind (not_found, timeout, exit_code, parse).",
        labels=["kind"],
    )
    for kind in ERROR_KINDS:
        errors.add_metric([kind], float(state.errors[kind]))
    yield errors
    yield GaugeMetricFamily(
        "mineru_gateway_npu_smi_up",
        "1 when the last npu-smi reading succeeded, else 0.",
        value=float(state.up),
    )
    duration = GaugeMetricFamily(
        "mineru_gateway_npu_smi_scrape_duration_seconds", "How long the last npu-smi reading took."
    )
    if state.last_duration_s is not None:
        duration.add_metric([], state.last_duration_s)
    yield duration
    yield GaugeMetricFamily(
        "mineru_gateway_npu_smi_last_success_timestamp_seconds",
        "Unix time of the last successful npu-smi reading; 0 before the first.",
        value=state.last_success_s or 0.0,
    )


def register_npu_metrics(
    registry: CollectorRegistry, telemetry: NpuTelemetry, *, npu_exporter_names: bool = True
) -> NpuMetricsCollector:
    """Registers the NPU collector on `registry` (never the global one) and returns it."""
    collector = NpuMetricsCollector(telemetry, npu_exporter_names=npu_exporter_names)
    registry.register(collector)
    return collector
