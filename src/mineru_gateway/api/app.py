"""`create_app(settings)`: the gateway as an ASGI app; all it uses is built in its lifespan."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson
import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Route

from mineru_gateway import __version__
from mineru_gateway.api.accounting import Accounting
from mineru_gateway.api.auth import bearer_match
from mineru_gateway.api.context import GatewayContext, Lifecycle, gateway_context
from mineru_gateway.api.limits import RequestLimits
from mineru_gateway.api.listeners import Listener, metrics_app, sibling_view
from mineru_gateway.api.media import MediaPolicy
from mineru_gateway.api.relay import PATHS, Relay, Scope, Send
from mineru_gateway.api.requests import Receive
from mineru_gateway.api.tenants import TenantDirectory
from mineru_gateway.api.usage import add_usage_route
from mineru_gateway.cache.service import build_result_cache
from mineru_gateway.config import GatewaySettings
from mineru_gateway.cost import CostModel
from mineru_gateway.errors import (
    Conflict,
    GatewayError,
    InvalidRequest,
    NoHealthyWorker,
    PermissionDenied,
    ShuttingDown,
    UnknownPath,
    UnknownWorker,
)
from mineru_gateway.flow import FairQueue, QueueLimits, RoomPolicy
from mineru_gateway.metrics import GatewayCollector, GatewayMetrics, QueueGauges
from mineru_gateway.reload import CredentialWatcher
from mineru_gateway.routing import LoadModel, make_policy
from mineru_gateway.siblings import (
    READER,
    SHARED_READINGS_PATH,
    SIBLING_SCOPE_KEY,
    Siblings,
    reading_json,
)
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
    siblings: Siblings | None = None,
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
    registry = WorkerRegistry(
        settings.workers,
        client,
        make_policy(settings.routing_policy, load_model),
        HealthPolicy(
            interval_s=settings.health_interval_s,
            timeout_s=settings.health_timeout_s,
            eject_after=settings.eject_after,
            slow_probes_to_eject=settings.slow_probes_to_eject,
        ),
        load_interval_s=settings.load_interval_s,
        load=load_model,
        pace_weighting=settings.pace_weighting,
        batch_limit=settings.batch_limit,
        metrics=metrics,
        rng=random.Random(),
        # One process reads the workers for all: each read costs a worker's API server CPU
        # (0.8 ms filtered, 7-8 ms for the whole page: benchmarks/results/scrape_cost.md).
        shared_readings=siblings.readings if siblings and siblings.index != READER else None,
        # Routing and flow control count every process's requests at once, not at the next
        # reading (benchmarks/results/processes_full_batch.md).
        group=siblings.group_load() if siblings is not None else None,
    )
    cost_model = CostModel(
        prefill_weight=settings.prefill_weight,
        decode_weight=settings.decode_weight,
        default_decode_tokens=settings.default_decode_tokens,
    )
    rolling = None
    if control is not None:
        rolling = RollingRestart(
            registry,
            control.restart,
            drain_timeout_s=settings.drain_timeout_s,
            ready_timeout_s=control.ready_timeout_s,
            probe_interval_s=min(settings.health_interval_s, 0.5),
        )
    return GatewayContext(
        settings=settings,
        client=client,
        registry=registry,
        rolling=rolling,
        dispatcher=build_dispatcher(settings, registry, load_model, siblings),
        tenants=TenantDirectory(settings),
        cost_model=cost_model,
        metrics=metrics,
        accounting=Accounting(metrics, cost_model),
        media=MediaPolicy(settings.media_urls, tuple(settings.media_allowlist)),
        limits=request_limits(settings),
        priority_header=settings.priority_header.lower().encode("latin-1"),
        lifecycle=lifecycle or Lifecycle(),
        siblings=siblings,
        results=build_result_cache(settings),
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
    siblings: Siblings | None = None,
) -> Dispatcher:
    """With sibling processes, tenants' limits and shares count every process's requests,
    and room goes to the most urgent request waiting in any of them (group_load.py)."""
    limits = QueueLimits(
        max_queued=settings.max_queued,
        max_queued_bytes=settings.max_queued_bytes,
        max_wait_s=settings.max_queue_wait_s,
    )
    room = RoomPolicy(
        headroom=settings.batch_headroom,
        min_headroom=settings.batch_headroom_min,
        load=load_model,
    )
    if siblings is None:
        return Dispatcher(registry, FairQueue(limits), room, enabled=settings.flow_control)
    tenants = siblings.group_tenants()
    doorbell = siblings.doorbell()
    dispatcher = Dispatcher(
        registry,
        FairQueue(limits, elsewhere=tenants),
        room,
        enabled=settings.flow_control,
        heads=siblings.queue_heads(tenants),
        ring=doorbell.ring,
    )
    doorbell.listen(dispatcher.pump)
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
    in_flight |= context.dispatcher.queue.in_flight_by_tenant()
    return QueueGauges(queued, in_flight)


def register_metrics(context: GatewayContext, telemetry: NpuTelemetry | None) -> None:
    """Registers the gateway's (and the NPUs') collectors on the context's own registry."""
    collector = GatewayCollector(
        context.metrics,
        context.registry.gauges,
        context.settings.routing_policy,
        lambda: queue_gauges(context),
    )
    context.metrics_registry.register(collector)
    if context.results is not None:
        context.metrics_registry.register(context.results.collector())
    if telemetry is not None:
        names = context.settings.npu_exporter_names
        register_npu_metrics(context.metrics_registry, telemetry, npu_exporter_names=names)


class GatewayApp:
    """The gateway's ASGI entry point: completions go straight to the relay, the rest to FastAPI.

    Every request and every streamed chunk of a completion would otherwise cross FastAPI's
    middleware stack (error, exception, telemetry and body-limit layers, each wrapping `send`).
    The relay handles its own errors, so it needs none of them; measured in
    benchmarks/results/gateway_overhead.md. Other methods on the relay's paths still reach
    FastAPI, which answers 405.
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
                await _send_error(send, error)
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
    siblings: Siblings | None = None,
) -> GatewayApp:
    """The gateway; `lifecycle.start_draining()` (on SIGTERM) stops admitting new requests.
    With `control` (from `up`) it can restart its workers one at a time; with `siblings` it is
    one of several processes sharing the port (siblings.py)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        context = build_context(settings, lifecycle, control, siblings)
        if settings.tracing:
            start_tracing()
        watcher = CredentialWatcher(settings, context.tenants, context.metrics.config_reloads)
        if context.rolling is not None:
            context.lifecycle.on_rolling_restart(_start_rolling(context.rolling))
        # One process reads npu-smi for all: each reading takes the driver's time.
        telemetry = build_telemetry(settings) if siblings is None or siblings.index == 0 else None
        register_metrics(context, telemetry)
        close_queue_before_deadline(context)
        discovery = DnsDiscovery(
            context.registry, settings.worker_dns, interval_s=settings.dns_interval_s
        )
        listeners: list[Listener] = []
        if siblings is not None:
            listeners.append(
                Listener(sibling_view(gateway, context.lifespan_state()), uds=siblings.own_socket)
            )
        if settings.metrics_port is not None:
            host = settings.metrics_host or settings.host
            listeners.append(
                Listener(
                    metrics_app(lambda: render_metrics(context, sibling=False)),
                    host=host,
                    port=settings.metrics_port,
                    reuse_port=siblings is not None,
                )
            )
        for listener in listeners:
            await listener.start()
        await context.client.start()
        await discovery.start()
        await context.registry.start()
        watcher.start()
        if telemetry is not None:
            await telemetry.start()
        log.info(
            "gateway_started",
            workers=settings.workers,
            healthy=[w.url for w in context.registry.workers if w.healthy],
            policy=settings.routing_policy,
        )
        try:
            yield context.lifespan_state()
        finally:
            for listener in listeners:
                await listener.stop()
            await watcher.stop()
            if context.rolling is not None:
                await context.rolling.stop()
            if telemetry is not None:
                await telemetry.stop()
            await discovery.stop()
            await context.registry.stop()
            await context.client.close()
            if context.results is not None:
                await context.results.close()
            if siblings is not None:
                await siblings.close()
            if settings.tracing:
                await stop_tracing()

    app = FastAPI(title="mineru-gateway", version=__version__, lifespan=lifespan)
    relays = {path: Relay(endpoint) for endpoint, path in PATHS.items()}
    for path, relay in relays.items():
        app.router.routes.append(Route(path, relay, methods=["POST"]))
    _add_control_routes(app)
    add_usage_route(app)
    _add_error_handlers(app)
    gateway = GatewayApp(app, relays, request_limits(settings))  # the lifespan's sibling view
    return gateway


def _from_sibling(request: Request) -> bool:
    """The request came over a sibling process's socket (siblings.py)."""
    return bool(request.scope.get(SIBLING_SCOPE_KEY))


async def render_metrics(context: GatewayContext, *, sibling: bool) -> bytes:
    """This process's exposition for a sibling's scrape, else the whole gateway's."""
    own = generate_latest(context.metrics_registry)
    if context.siblings is None or sibling:
        return own
    return await context.siblings.metrics(own)


async def _workers_view(request: Request) -> dict[str, Any]:
    """`_describe_workers`, with the in-flight figures of every process when there are several
    (a drained worker is idle when no process has a request on it)."""
    context = _context(request)
    view = _describe_workers(context)
    siblings = context.siblings
    if siblings is None or _from_sibling(request):
        return view
    headers = {"authorization": value} if (value := request.headers.get("authorization")) else {}
    answers = await asyncio.gather(
        *(siblings.request(index, "GET", "/v1/workers", headers) for index in siblings.others),
        return_exceptions=True,
    )
    by_url = {worker["url"]: worker for worker in view["workers"]}
    for answer in answers:
        if isinstance(answer, BaseException) or answer[0] != 200:
            continue
        for theirs in orjson.loads(answer[1])["workers"]:
            ours = by_url.get(theirs["url"])
            if ours is not None:
                for key in ("in_flight", "estimated_cost"):
                    ours[key] += theirs[key]
    view["processes"] = siblings.count
    return view


async def propagate(request: Request) -> None:
    """Repeats an operator's change, just applied here, on the other processes."""
    context = _context(request)
    if context.siblings is None or _from_sibling(request):
        return
    headers = {
        name: value
        for name in ("authorization", "content-type")
        if (value := request.headers.get(name)) is not None
    }
    body = await request.body()
    failed = await context.siblings.forward(request.method, request.url.path, headers, body)
    if failed:
        raise GatewayError(
            f"the change was made in this process but failed in {failed} of the gateway's "
            f"other {context.siblings.count - 1} processes; see the gateway's log"
        )


def _start_rolling(rolling: RollingRestart) -> Callable[[], None]:
    def start() -> None:
        if rolling.running:
            log.info("rolling_restart_already_running")
        else:
            rolling.start()

    return start


def _context(request: Request) -> GatewayContext:
    return gateway_context(request.scope)


def _add_control_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the gateway process answers."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """Readiness: at least one worker can serve."""
        context = _context(request)
        registry = context.registry
        if context.lifecycle.draining:
            raise ShuttingDown("the gateway is shutting down")
        if not registry.any_healthy():
            raise NoHealthyWorker("no healthy worker")
        healthy = sum(worker.healthy for worker in registry.workers)
        return _json({"status": "ready", "healthy_workers": healthy})

    @app.get("/v1/models", dependencies=[Depends(_authorized)])
    async def models(request: Request) -> Response:
        """The union of the healthy workers' models, one entry per model id."""
        registry = _context(request).registry
        if not registry.any_healthy():
            raise NoHealthyWorker("no healthy worker to list models from")
        return _json({"object": "list", "data": registry.models()})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus metrics of this gateway (and of the NPUs, when npu_smi is set)."""
        context = _context(request)
        sibling = _from_sibling(request)
        if context.settings.metrics_port is not None and not sibling:
            raise UnknownPath(
                "/metrics is served on the metrics listener (MINERU_GATEWAY_METRICS_PORT), "
                "not on this port"
            )
        body = await render_metrics(context, sibling=sibling)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get(SHARED_READINGS_PATH)
    async def readings(request: Request) -> Response:
        """The workers' load figures this process read, for its siblings only (siblings.py):
        with several processes, the first reads every worker's `/metrics` for all."""
        if not _from_sibling(request):
            raise UnknownPath(f"{SHARED_READINGS_PATH} is for the gateway's own processes")
        context = _context(request)
        readings = context.registry.readings(max_age_s=context.settings.stale_after_s)
        return _json({url: reading_json(reading) for url, reading in readings.items()})

    @app.get("/v1/workers", dependencies=[Depends(_client_or_admin)])
    async def workers(request: Request) -> Response:
        """Each worker's URL, state, load (own and reported) and last error."""
        return _json(await _workers_view(request))

    @app.post("/v1/workers", dependencies=[Depends(_admin)])
    async def add_worker(request: Request, change: WorkerChange) -> Response:
        """Adds a worker at run time; it takes traffic once its health check passes."""
        registry = _context(request).registry
        await registry.check(registry.add(change.url))
        await propagate(request)
        return _json(await _workers_view(request), 201)

    @app.delete("/v1/workers", dependencies=[Depends(_admin)])
    async def remove_worker(request: Request, change: WorkerChange) -> Response:
        """Stops routing new requests to a worker; those already there finish normally."""
        _context(request).registry.remove(change.url)
        await propagate(request)
        return _json(await _workers_view(request))

    @app.post("/v1/workers/drain", dependencies=[Depends(_admin)])
    async def drain_worker(request: Request, change: WorkerChange) -> Response:
        """No new requests to a worker (queued ones go to the others); those on it finish.
        Its `in_flight` in the answer (and in GET /v1/workers) says when it is idle."""
        _known(_context(request), change.url).drain(change.url)
        await propagate(request)
        return _json(await _workers_view(request))

    @app.post("/v1/workers/undrain", dependencies=[Depends(_admin)])
    async def undrain_worker(request: Request, change: WorkerChange) -> Response:
        """A drained worker takes requests again (once its health check passes)."""
        _known(_context(request), change.url).undrain(change.url)
        await propagate(request)
        return _json(await _workers_view(request))

    @app.post("/v1/workers/restart", dependencies=[Depends(_admin)])
    async def restart_workers(request: Request, change: RestartRequest) -> Response:
        """A rolling restart of the workers `up` runs (all, or `urls`), one at a time: 202, then
        GET /v1/workers/restart says how it goes."""
        rolling = _rolling(_context(request))
        rolling.start(change.urls)
        return _json(rolling.describe(), 202)

    @app.get("/v1/workers/restart", dependencies=[Depends(_admin)])
    async def restart_status(request: Request) -> Response:
        """The current or last rolling restart: its state and each worker's phase."""
        return _json(_rolling(_context(request)).describe())


class WorkerChange(BaseModel):
    url: str = Field(pattern=r"^https?://[^/]+$", description="A worker's base URL.")


class RestartRequest(BaseModel):
    urls: list[str] | None = Field(None, description="Workers to restart; default: all.")


def _known(context: GatewayContext, url: str) -> WorkerRegistry:
    if url not in {worker.url for worker in context.registry.workers}:
        raise UnknownWorker(f"no worker {url} in this gateway", param="url")
    return context.registry


def _rolling(context: GatewayContext) -> RollingRestart:
    if context.rolling is None:
        raise Conflict(
            "this gateway does not run its workers (`serve`): restart them one at a time with "
            "POST /v1/workers/drain, your own restart, POST /v1/workers/undrain; `up` does it "
            "all with POST /v1/workers/restart or SIGHUP",
            code="not_supervised",
        )
    return context.rolling


def _admin(request: Request) -> None:
    """What changes the gateway needs an admin key, distinct from every client key (issue 14):
    a client must not add its own server and receive other tenants' requests."""
    keys = _context(request).settings.all_admin_keys
    if not keys:
        raise PermissionDenied(
            "changing the gateway's workers is off: set MINERU_GATEWAY_ADMIN_KEYS to enable it",
            code="admin_disabled",
        )
    if not _is_admin(request):
        raise PermissionDenied("this needs an admin key (Authorization: Bearer <admin key>)")


def _is_admin(request: Request) -> bool:
    keys = _context(request).settings.all_admin_keys
    header = request.headers.get("authorization", "").encode()
    return bearer_match(header, ((key.encode(), True) for key in keys)) is True


def _authorized(request: Request) -> None:
    _context(request).tenants.authenticate(request.headers.get("authorization", "").encode())


def _client_or_admin(request: Request) -> None:
    """What a client may read an operator may read too (`mineru-gateway workers list`)."""
    if not _is_admin(request):
        _authorized(request)


def _describe_workers(context: GatewayContext) -> dict[str, Any]:
    now = time.monotonic()
    registry = context.registry
    return {"policy": registry.policy.name, "workers": [w.describe(now) for w in registry.workers]}


def _json(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


async def _send_error(send: Send, error: GatewayError) -> None:
    """An error answered below FastAPI (before a request reaches it)."""
    headers = [(b"content-type", b"application/json"), *error.headers()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error.body_bytes()})


def _error_response(error: GatewayError) -> Response:
    headers = {name.decode(): value.decode() for name, value in error.headers()}
    return _json(error.body(), error.status, headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, error: GatewayError) -> Response:
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        body = GatewayError(str(error.detail)).body()
        code = HTTPStatus(error.status_code).phrase.lower().replace(" ", "_")
        body["error"].update(type="invalid_request_error", code=code)
        return _json(body, error.status_code, error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        return _error_response(InvalidRequest(str(first.get("msg", error)), param=param))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        # The top-level handler: the one place a bare Exception is caught (STYLE.md).
        log.exception("unhandled_error", path=request.url.path)
        return _error_response(GatewayError("internal gateway error"))
