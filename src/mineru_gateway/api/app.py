"""`create_app(settings)`: the gateway as an ASGI app; all it uses is built in its lifespan.

This module wires the parts together: the registry (workers/registry.py), the dispatcher
(workers/dispatcher.py), the relay (api/relay.py), the control routes (api/control.py) and the
error handlers (api/error_handlers.py).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import structlog
from fastapi import FastAPI
from starlette.routing import Route

from mineru_gateway import __version__
from mineru_gateway.api.accounting import Accounting
from mineru_gateway.api.context import GatewayContext, Lifecycle
from mineru_gateway.api.control import render_metrics
from mineru_gateway.api.control import router as control_routes
from mineru_gateway.api.error_handlers import add_error_handlers, send_error
from mineru_gateway.api.limits import RequestLimits
from mineru_gateway.api.listeners import Listener, metrics_app
from mineru_gateway.api.media import MediaPolicy
from mineru_gateway.api.relay import PATHS, Relay, Scope, Send
from mineru_gateway.api.requests import Receive
from mineru_gateway.api.tenants import TenantDirectory
from mineru_gateway.api.usage import add_usage_route
from mineru_gateway.cache.service import build_result_cache
from mineru_gateway.config import GatewaySettings
from mineru_gateway.cost import CostModel
from mineru_gateway.errors import GatewayError
from mineru_gateway.fleet import build_fleet_slots, build_fleet_tenants
from mineru_gateway.fleet.backlog import BacklogCollector
from mineru_gateway.flow import FairQueue, QueueLimits, RoomPolicy
from mineru_gateway.metrics import (
    PER_WORKER_UP_TO,
    GatewayCollector,
    GatewayMetrics,
    QueueGauges,
)
from mineru_gateway.reload import CredentialWatcher
from mineru_gateway.routing import LoadModel, make_policy
from mineru_gateway.telemetry import (
    NpuSmiSource,
    NpuTelemetry,
    find_npu_smi,
    parse_device_workers,
    register_npu_metrics,
)
from mineru_gateway.tracing.setup import start_tracing, stop_tracing
from mineru_gateway.workers.discovery import DnsDiscovery
from mineru_gateway.workers.dispatcher import Dispatcher
from mineru_gateway.workers.registry import HealthPolicy, WorkerRegistry
from mineru_gateway.workers.rolling import Restart, RollingRestart
from mineru_gateway.workers.sweep import Budget
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient

log = structlog.get_logger("mineru_gateway.app")


@dataclass(frozen=True, slots=True)
class WorkerControl:
    """What `up` lends the gateway to restart the workers it runs (rolling restarts)."""

    restart: Restart
    ready_timeout_s: float


def build_context(
    settings: GatewaySettings,
    lifecycle: Lifecycle | None = None,
    control: WorkerControl | None = None,
) -> GatewayContext:
    client = UpstreamClient(
        Timeouts(
            connect_s=settings.connect_timeout_s,
            first_byte_s=settings.first_byte_timeout_s,
            idle_s=settings.idle_stream_timeout_s,
        )
    )
    metrics = GatewayMetrics()
    load_model = LoadModel(
        stale_after_s=settings.stale_after_s,
        kv_avoid_above=settings.kv_avoid_above,
        waiting_weight=settings.waiting_weight,
    )
    registry = build_registry(settings, client, metrics, load_model)
    metrics.worker_labels.per_worker = per_worker_metrics(settings, registry)
    cost_model = CostModel(
        prefill_weight=settings.prefill_weight,
        decode_weight=settings.decode_weight,
        default_decode_tokens=settings.default_decode_tokens,
    )
    return GatewayContext(
        settings=settings,
        client=client,
        registry=registry,
        rolling=build_rolling(settings, registry, control),
        dispatcher=build_dispatcher(settings, registry, load_model),
        tenants=TenantDirectory(settings),
        cost_model=cost_model,
        metrics=metrics,
        accounting=Accounting(metrics, cost_model),
        media=MediaPolicy(settings.media_urls, tuple(settings.media_allowlist)),
        limits=request_limits(settings),
        priority_header=settings.priority_header.lower().encode("latin-1"),
        document_header=settings.document_header.lower().encode("latin-1"),
        lifecycle=lifecycle or Lifecycle(),
        results=build_result_cache(settings),
    )


def per_worker_metrics(settings: GatewaySettings, registry: WorkerRegistry) -> Callable[[], bool]:
    """Whether request and latency series are labelled by worker (metrics.py): as set, else
    while the fleet has at most PER_WORKER_UP_TO workers (docs/operate/fleet-scale.md)."""
    chosen = settings.per_worker_metrics
    if chosen is not None:
        return lambda: chosen
    workers = registry.membership.by_url
    return lambda: len(workers) <= PER_WORKER_UP_TO


def build_registry(
    settings: GatewaySettings,
    client: UpstreamClient,
    metrics: GatewayMetrics,
    load_model: LoadModel,
) -> WorkerRegistry:
    return WorkerRegistry(
        settings.workers,
        client,
        make_policy(settings.routing_policy, load_model),
        HealthPolicy(
            interval_s=settings.health_interval_s,
            timeout_s=settings.health_timeout_s,
            eject_after=settings.eject_after,
            slow_probes_to_eject=settings.slow_probes_to_eject,
            busy_hold_s=settings.busy_hold_s,
        ),
        load_interval_s=settings.load_interval_s,
        load=load_model,
        pace_weighting=settings.pace_weighting,
        batch_limit=settings.batch_limit,
        metrics=metrics,
        rng=random.Random(),
        sample=settings.routing_sample,
        budget=Budget(settings.max_worker_gets_per_s, settings.max_fleet_gets_per_s),
    )


def build_rolling(
    settings: GatewaySettings, registry: WorkerRegistry, control: WorkerControl | None
) -> RollingRestart | None:
    if control is None:
        return None
    return RollingRestart(
        registry,
        control.restart,
        drain_timeout_s=settings.drain_timeout_s,
        ready_timeout_s=control.ready_timeout_s,
        probe_interval_s=min(settings.health_interval_s, 0.5),
    )


def request_limits(settings: GatewaySettings) -> RequestLimits:
    return RequestLimits(
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        max_json_depth=settings.max_json_depth,
        max_messages=settings.max_messages,
        max_content_parts=settings.max_content_parts,
        max_images=settings.max_images,
        max_image_pixels=settings.max_image_pixels,
        max_image_side=settings.max_image_side,
        max_image_aspect=settings.max_image_aspect,
        max_tokens=settings.max_tokens_limit,
    )


def build_dispatcher(
    settings: GatewaySettings,
    registry: WorkerRegistry,
    load_model: LoadModel,
) -> Dispatcher:
    """With fleet state on, tenants' limits and shares count every replica's requests
    (docs/operate/fleet-state.md)."""
    limits = QueueLimits(
        max_queued=settings.max_queued,
        max_queued_bytes=settings.max_queued_bytes,
        max_wait_s=settings.max_queue_wait_s,
        max_flows=settings.max_flows_per_tenant,
        order_steps=settings.order_steps,
    )
    room = RoomPolicy(
        headroom=settings.batch_headroom,
        min_headroom=settings.batch_headroom_min,
        reserve=settings.batch_reserve,
        load=load_model,
    )
    fleet = build_fleet_slots(settings)  # tenants' in-flight slots shared by every replica
    shared = build_fleet_tenants(settings, fleet)  # the other replicas' counts of each tenant
    dispatcher = Dispatcher(
        registry,
        FairQueue(limits, elsewhere=shared),
        room,
        enabled=settings.flow_control,
        fleet=fleet,
        fleet_tenants=shared,
    )
    if shared is not None:
        shared.on_change = dispatcher.pump  # others' counts changed: order and limits may too
        registry.replicas = shared.replicas  # they share each worker's budget of GETs
    return dispatcher


def close_queue_before_deadline(context: GatewayContext) -> None:
    """On SIGTERM: queued requests keep being served until just before the drain deadline,
    then get 503 (uvicorn cuts whatever is left at the deadline itself)."""
    loop = asyncio.get_running_loop()
    drain = context.settings.drain_timeout_s
    delay = max(0.0, drain - min(1.0, drain / 10))

    def schedule_close() -> None:
        loop.call_later(delay, context.dispatcher.close)

    context.lifecycle.on_drain(schedule_close)


def build_telemetry(settings: GatewaySettings) -> NpuTelemetry | None:
    """None for `npu_smi` off, and for auto where no npu-smi is installed (`find_npu_smi`)."""
    path = find_npu_smi(settings.npu_smi)
    if path is None:
        if settings.npu_smi == "auto":
            log.info("npu_telemetry_off", reason="no npu-smi on PATH or in /usr/local/[s]bin")
        return None
    source = NpuSmiSource(path)
    devices = parse_device_workers(settings.npu_devices) if settings.npu_devices else {}
    return NpuTelemetry(source, interval_s=settings.npu_smi_interval_s, device_workers=devices)


def queue_gauges(context: GatewayContext) -> QueueGauges:
    """The queue by tenant and priority label; every known tenant shows, queued or not."""
    tenants = context.tenants
    queued: dict[tuple[str, str], tuple[int, int]] = {
        (name, tenants.priority_label(policy.priority)): (0, 0)
        for name, policy in tenants.policies().items()
    }
    for (name, priority), (count, size) in context.dispatcher.queue.depth().items():
        key = (name, tenants.priority_label(priority))
        before = queued.get(key, (0, 0))
        queued[key] = (before[0] + count, before[1] + size)
    in_flight = dict.fromkeys(tenants.policies(), 0)
    queue = context.dispatcher.queue
    in_flight |= queue.in_flight_by_tenant()
    flows = dict.fromkeys(tenants.policies(), 0)
    flows |= queue.flows_by_tenant()
    return QueueGauges(queued, in_flight, flows, queue.by_task())


def register_metrics(context: GatewayContext, telemetry: NpuTelemetry | None) -> None:
    """Registers the gateway's (and the NPUs') collectors on the context's own registry."""
    collector = GatewayCollector(
        context.metrics,
        context.registry.membership.gauges,
        context.settings.routing_policy,
        lambda: queue_gauges(context),
    )
    context.metrics_registry.register(collector)
    context.metrics_registry.register(BacklogCollector(context.dispatcher))
    dispatcher = context.dispatcher
    if dispatcher.fleet is not None:
        context.metrics_registry.register(dispatcher.fleet.collector(dispatcher.fleet_tenants))
    if context.results is not None:
        context.metrics_registry.register(context.results.collector())
    if telemetry is not None:
        names = context.settings.npu_exporter_names
        register_npu_metrics(context.metrics_registry, telemetry, npu_exporter_names=names)


class GatewayApp:
    """The gateway's ASGI entry point: completions go straight to the relay, the rest to FastAPI.

    Every request and every streamed chunk of a completion would otherwise cross FastAPI's
    middleware stack (error, exception, telemetry and body-limit layers, each wrapping `send`).
    The relay handles its own errors, so it needs none of them (docs/proxy-costs.md). Other
    methods on the relay's paths still reach FastAPI, which answers 405.
    """

    def __init__(
        self, api: FastAPI, relays: Mapping[str, Relay], limits: RequestLimits | None = None
    ) -> None:
        self.api = api
        self.relays = dict(relays)
        self.limits = limits or RequestLimits()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                self.limits.check_headers(scope["headers"])
            except GatewayError as error:
                await send_error(send, error)
                return
        if scope["type"] == "http" and scope["method"] == "POST":
            relay = self.relays.get(scope["path"])
            if relay is not None:
                await relay(scope, receive, send)
                return
        await self.api(scope, receive, send)


def create_app(
    settings: GatewaySettings,
    lifecycle: Lifecycle | None = None,
    control: WorkerControl | None = None,
) -> GatewayApp:
    """The gateway; `lifecycle.start_draining()` (on SIGTERM) stops admitting new requests.
    With `control` (from `up`) it can restart its workers one at a time."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        running = Running(settings, build_context(settings, lifecycle, control))
        await running.start()
        try:
            yield running.context.lifespan_state()
        finally:
            await running.stop()

    app = FastAPI(title="mineru-gateway", version=__version__, lifespan=lifespan)
    relays = {path: Relay(endpoint) for endpoint, path in PATHS.items()}
    for path, relay in relays.items():
        app.router.routes.append(Route(path, relay, methods=["POST"]))
    app.include_router(control_routes)
    add_usage_route(app)
    add_error_handlers(app)
    return GatewayApp(app, relays, request_limits(settings))


class Running:
    """What the gateway starts beside its routes, and stops in reverse at shutdown."""

    def __init__(self, settings: GatewaySettings, context: GatewayContext) -> None:
        self.settings = settings
        self.context = context
        self.telemetry = build_telemetry(settings)
        self.discovery = DnsDiscovery(
            context.registry, settings.worker_dns, interval_s=settings.dns_interval_s
        )
        self.listeners: list[Listener] = []
        self.watcher = CredentialWatcher(settings, context.tenants, context.metrics.config_reloads)

    async def start(self) -> None:
        context, settings = self.context, self.settings
        if settings.tracing:
            start_tracing()
        if context.rolling is not None:
            context.lifecycle.on_rolling_restart(_start_rolling(context.rolling))
        register_metrics(context, self.telemetry)
        close_queue_before_deadline(context)
        self.listeners = self._listeners()
        for listener in self.listeners:
            await listener.start()
        await context.client.start()
        await self.discovery.start()
        await context.registry.start()
        self.watcher.start()
        await context.dispatcher.start()
        if self.telemetry is not None:
            await self.telemetry.start()
        log.info(
            "gateway_started",
            workers=settings.workers,
            healthy=[w.url for w in context.registry.membership.workers if w.healthy],
            policy=settings.routing_policy,
        )

    def _listeners(self) -> list[Listener]:
        """A metrics port when one is set."""
        context, settings = self.context, self.settings
        if settings.metrics_port is None:
            return []
        return [
            Listener(
                metrics_app(lambda: render_metrics(context)),
                host=settings.metrics_host or settings.host,
                port=settings.metrics_port,
            )
        ]

    async def stop(self) -> None:
        context = self.context
        for listener in self.listeners:
            await listener.stop()
        await self.watcher.stop()
        if context.rolling is not None:
            await context.rolling.stop()
        if self.telemetry is not None:
            await self.telemetry.stop()
        await self.discovery.stop()
        await context.dispatcher.stop()
        await context.registry.stop()
        await context.client.close()
        if context.results is not None:
            await context.results.close()
        if self.settings.tracing:
            await stop_tracing()


def _start_rolling(rolling: RollingRestart) -> Callable[[], None]:
    def start() -> None:
        if rolling.running:
            log.info("rolling_restart_already_running")
        else:
            rolling.start()

    return start
