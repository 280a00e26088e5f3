"""NPU telemetry: `npu-smi` readings exported as Prometheus metrics (docs/npu-telemetry.md).

npu_smi     pure parsers over npu-smi's text
source      runs npu-smi (timeouts, typed errors) -> NpuSnapshot; which npu-smi a setting means
collector   NpuTelemetry (periodic refresh, cached) and the Prometheus collector
exporter    the same as a small standalone process
"""

from mineru_gateway.telemetry.collector import (
    DEFAULT_INTERVAL_S,
    NpuMetricsCollector,
    NpuTelemetry,
    TelemetryState,
    register_npu_metrics,
)
from mineru_gateway.telemetry.exporter import (
    DEFAULT_EXPORTER_PORT,
    create_exporter_app,
    parse_device_workers,
)
from mineru_gateway.telemetry.npu_smi import (
    ChipReadings,
    NpuChip,
    NpuProcess,
    apply_readings,
    parse_info,
    parse_key_values,
    parse_version,
    readings_from_key_values,
)
from mineru_gateway.telemetry.source import (
    DEFAULT_TIMEOUT_S,
    ERROR_KINDS,
    NPU_SMI_LOCATIONS,
    ErrorKind,
    NpuSmiError,
    NpuSmiExitError,
    NpuSmiNotFound,
    NpuSmiParseError,
    NpuSmiSource,
    NpuSmiTimeout,
    NpuSnapshot,
    NpuSource,
    find_npu_smi,
)

__all__ = [
    "DEFAULT_EXPORTER_PORT",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_TIMEOUT_S",
    "ERROR_KINDS",
    "NPU_SMI_LOCATIONS",
    "ChipReadings",
    "ErrorKind",
    "NpuChip",
    "NpuMetricsCollector",
    "NpuProcess",
    "NpuSmiError",
    "NpuSmiExitError",
    "NpuSmiNotFound",
    "NpuSmiParseError",
    "NpuSmiSource",
    "NpuSmiTimeout",
    "NpuSnapshot",
    "NpuSource",
    "NpuTelemetry",
    "TelemetryState",
    "apply_readings",
    "create_exporter_app",
    "find_npu_smi",
    "parse_device_workers",
    "parse_info",
    "parse_key_values",
    "parse_version",
    "readings_from_key_values",
    "register_npu_metrics",
]
