"""The NPU exporter as its own small process, for NPU hosts where the gateway does not run.

`create_exporter_app(...)` is an ASGI app serving `/metrics` (Prometheus text, or OpenMetrics when
asked) and `/health`; its lifespan builds the source, the telemetry and a registry of its own, and
starts and stops the refresh task. `mineru-gateway npu-exporter` serves it on uvicorn.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mineru_gateway.telemetry.collector import (
    DEFAULT_INTERVAL_S,
    NpuTelemetry,
    register_npu_metrics,
)
from mineru_gateway.telemetry.source import DEFAULT_TIMEOUT_S, NpuSmiSource

# Next to npu-exporter's 8082, so both can run on one host.
DEFAULT_EXPORTER_PORT = 8083


@dataclass(frozen=True, slots=True)
class ExporterState:
    registry: CollectorRegistry
    telemetry: NpuTelemetry


def create_exporter_app(
    *,
    npu_smi_path: str | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device_workers: Mapping[int, str] | None = None,
    npu_exporter_names: bool = True,
) -> Starlette:
    """The exporter's ASGI app; nothing runs until its lifespan starts."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, ExporterState]]:
        source = NpuSmiSource(npu_smi_path, timeout_s=timeout_s)
        telemetry = NpuTelemetry(source, interval_s=interval_s, device_workers=device_workers)
        registry = CollectorRegistry()
        register_npu_metrics(registry, telemetry, npu_exporter_names=npu_exporter_names)
        await telemetry.start()
        try:
            yield {"exporter": ExporterState(registry, telemetry)}
        finally:
            await telemetry.stop()

    routes = [Route("/metrics", _metrics), Route("/health", _health)]
    return Starlette(routes=routes, lifespan=lifespan)


async def _metrics(request: Request) -> Response:
    state: ExporterState = request.state.exporter
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encoder(state.registry), headers={"Content-Type": content_type})


async def _health(request: Request) -> Response:
    """The exporter is up; whether npu-smi answers is in the body and in /metrics."""
    telemetry_state = request.state.exporter.telemetry.state
    body = {
        "status": "ok",
        "npu_smi_up": telemetry_state.up,
        "last_success_timestamp_seconds": telemetry_state.last_success_s,
    }
    return JSONResponse(body)


def parse_device_workers(spec: str) -> dict[int, str]:
    """`0=http://10.0.0.5:30001,1=worker-b` -> {0: "http://10.0.0.5:30001", 1: "worker-b"}."""
    mapping: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        device, equals, worker = item.partition("=")
        if not equals or not device.strip().isdigit() or not worker.strip():
            raise ValueError(f"expected DEVICE=WORKER, got {item!r}")
        mapping[int(device)] = worker.strip()
    return mapping
