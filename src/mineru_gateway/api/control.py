"""The gateway's own routes: liveness, readiness, models, metrics, and the workers' control.

`/v1/workers` changes (add, remove, drain, undrain) need an admin key, distinct from every client
key.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.responses import Response

from mineru_gateway.api.auth import bearer_match
from mineru_gateway.api.context import GatewayContext, gateway_context
from mineru_gateway.errors import (
    Conflict,
    NoHealthyWorker,
    PermissionDenied,
    ShuttingDown,
    UnknownPath,
    UnknownWorker,
)
from mineru_gateway.workers.membership import Membership
from mineru_gateway.workers.rolling import RollingRestart

router = APIRouter()


class WorkerChange(BaseModel):
    url: str = Field(pattern=r"^https?://[^/]+$", description="A worker's base URL.")


class RestartRequest(BaseModel):
    urls: list[str] | None = Field(None, description="Workers to restart; default: all.")


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


def _context(request: Request) -> GatewayContext:
    return gateway_context(request.scope)


# -- who may call what ----------------------------------------------------------------------
def _admin(request: Request) -> None:
    """What changes the gateway needs an admin key, distinct from every client key: a client
    must not add its own server and receive other tenants' requests."""
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


# -- liveness, readiness, models, metrics ---------------------------------------------------
@router.get("/health")
async def health() -> dict[str, str]:
    """Liveness: the gateway process answers."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness: at least one worker can serve."""
    context = _context(request)
    registry = context.registry
    if context.lifecycle.draining:
        raise ShuttingDown("the gateway is shutting down")
    if not registry.membership.any_healthy():
        raise NoHealthyWorker("no healthy worker")
    healthy = sum(worker.healthy for worker in registry.membership.workers)
    return json_response({"status": "ready", "healthy_workers": healthy})


@router.get("/v1/models", dependencies=[Depends(_authorized)])
async def models(request: Request) -> Response:
    """The union of the healthy workers' models, one entry per model id."""
    registry = _context(request).registry
    if not registry.membership.any_healthy():
        raise NoHealthyWorker("no healthy worker to list models from")
    return json_response({"object": "list", "data": registry.membership.models()})


async def render_metrics(context: GatewayContext) -> bytes:
    """The gateway's exposition, reused while young next to its cost (metrics.py)."""
    cache = context.metrics.exposition
    cached = cache.get(time.monotonic())
    if cached is not None:
        return cached
    cpu = time.thread_time()
    body = generate_latest(context.metrics_registry)
    cache.put(body, time.monotonic(), time.thread_time() - cpu)
    return body


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics of this gateway (and of the NPUs, when npu_smi is set)."""
    context = _context(request)
    if context.settings.metrics_port is not None:
        raise UnknownPath(
            "/metrics is served on the metrics listener (MINERU_GATEWAY_METRICS_PORT), "
            "not on this port"
        )
    return Response(await render_metrics(context), media_type=CONTENT_TYPE_LATEST)


# -- the workers ----------------------------------------------------------------------------
@router.get("/v1/workers", dependencies=[Depends(_client_or_admin)])
async def workers(request: Request) -> Response:
    """Each worker's URL, state, load (own and reported) and last error."""
    return json_response(_describe_workers(_context(request)))


@router.post("/v1/workers", dependencies=[Depends(_admin)])
async def add_worker(request: Request, change: WorkerChange) -> Response:
    """Adds a worker at run time; it takes traffic once its health check passes."""
    registry = _context(request).registry
    await registry.checks.check(registry.membership.add(change.url))
    return json_response(_describe_workers(_context(request)), 201)


@router.delete("/v1/workers", dependencies=[Depends(_admin)])
async def remove_worker(request: Request, change: WorkerChange) -> Response:
    """Stops routing new requests to a worker; those already there finish normally."""
    _context(request).registry.membership.remove(change.url)
    return json_response(_describe_workers(_context(request)))


@router.post("/v1/workers/drain", dependencies=[Depends(_admin)])
async def drain_worker(request: Request, change: WorkerChange) -> Response:
    """No new requests to a worker (queued ones go to the others); those on it finish.
    Its `in_flight` in the answer (and in GET /v1/workers) says when it is idle."""
    _known(_context(request), change.url).drain(change.url)
    return json_response(_describe_workers(_context(request)))


@router.post("/v1/workers/undrain", dependencies=[Depends(_admin)])
async def undrain_worker(request: Request, change: WorkerChange) -> Response:
    """A drained worker takes requests again (once its health check passes)."""
    _known(_context(request), change.url).undrain(change.url)
    return json_response(_describe_workers(_context(request)))


@router.post("/v1/workers/restart", dependencies=[Depends(_admin)])
async def restart_workers(request: Request, change: RestartRequest) -> Response:
    """A rolling restart of the workers `up` runs (all, or `urls`), one at a time: 202, then
    GET /v1/workers/restart says how it goes."""
    rolling = _rolling(_context(request))
    rolling.start(change.urls)
    return json_response(rolling.describe(), 202)


@router.get("/v1/workers/restart", dependencies=[Depends(_admin)])
async def restart_status(request: Request) -> Response:
    """The current or last rolling restart: its state and each worker's phase."""
    return json_response(_rolling(_context(request)).describe())


def _known(context: GatewayContext, url: str) -> Membership:
    membership = context.registry.membership
    if url not in membership.by_url:
        raise UnknownWorker(f"no worker {url} in this gateway", param="url")
    return membership


def _rolling(context: GatewayContext) -> RollingRestart:
    if context.rolling is None:
        raise Conflict(
            "this gateway does not run its workers (`serve`): restart them one at a time with "
            "POST /v1/workers/drain, your own restart, POST /v1/workers/undrain; `up` does it "
            "all with POST /v1/workers/restart or SIGHUP",
            code="not_supervised",
        )
    return context.rolling


def _describe_workers(context: GatewayContext) -> dict[str, Any]:
    now = time.monotonic()
    registry = context.registry
    return {
        "policy": registry.routing.policy.name,
        "workers": [w.describe(now) for w in registry.membership.workers],
    }
