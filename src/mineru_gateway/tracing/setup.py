"""Starting and stopping the OpenTelemetry SDK, with its standard OTEL_* settings.

One provider per process, the gateway's own (not installed as OpenTelemetry's global one, so a
library that traces on its own does not send through it). Spans go out through a batch span
processor: ending a span appends it to a bounded queue under a lock, and a thread of the SDK's
exports them, so the event loop never waits for the collector; a full queue drops spans rather
than blocking (OTEL_BSP_MAX_QUEUE_SIZE).
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

import structlog

from mineru_gateway import tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = structlog.get_logger("mineru_gateway.tracing")

SERVICE_NAME = "mineru-gateway"  # unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES say
HTTP_PROTOBUF = "http/protobuf"

_provider: TracerProvider | None = None


def protocol() -> str:
    """OTLP's protocol for traces, as the OTEL_* variables name it (http/protobuf by default)."""
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or HTTP_PROTOBUF
    )


def start_tracing() -> bool:
    """Starts the SDK and turns tracing on for this process; False when OTEL_SDK_DISABLED says
    not to. Raises ValueError for a protocol it cannot send."""
    global _provider
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("tracing_off", reason="OTEL_SDK_DISABLED=true")
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from mineru_gateway.tracing import spans

    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    resource = Resource.create({} if named else {"service.name": SERVICE_NAME})
    # The sampler comes from OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (the SDK reads them).
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(_exporter()))
    _provider = provider
    spans.use(provider.get_tracer("mineru_gateway"))
    tracing.ENABLED = True
    log.info("tracing_on", protocol=protocol(), sampler=os.environ.get("OTEL_TRACES_SAMPLER"))
    return True


def _exporter() -> SpanExporter:
    chosen = protocol()
    if chosen == HTTP_PROTOBUF:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # endpoint, headers, timeout: OTEL_EXPORTER_OTLP_*
    if chosen == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise ValueError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc "
                "installed; http/protobuf is built in"
            ) from None
        exporter: SpanExporter = GrpcExporter()
        return exporter
    raise ValueError(f"OTLP protocol {chosen!r}: the gateway sends http/protobuf or grpc")


async def stop_tracing() -> None:
    """Turns tracing off and sends what is still queued (in a thread: the export blocks)."""
    global _provider
    provider, _provider = _provider, None
    tracing.ENABLED = False
    if provider is not None:
        await asyncio.to_thread(provider.shutdown)
