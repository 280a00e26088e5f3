"""What a request handler may use: built once per app in the lifespan, never a global.

Handlers reach it through one typed accessor, `gateway_context(scope)`, never by string keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from mineru_gateway.api.accounting import Accounting
from mineru_gateway.api.limits import RequestLimits
from mineru_gateway.api.media import MediaPolicy
from mineru_gateway.api.tenants import TenantDirectory
from mineru_gateway.config import GatewaySettings
from mineru_gateway.cost import CostModel
from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.workers.dispatcher import Dispatcher
from mineru_gateway.workers.registry import WorkerRegistry
from mineru_gateway.workers.rolling import RollingRestart
from mineru_gateway.workers.upstream import UpstreamClient

if TYPE_CHECKING:
    from mineru_gateway.cache.service import ResultCache

STATE_KEY = "gateway"


@dataclass(slots=True)
class Lifecycle:
    """Set by the server's signal handler: from then on the gateway admits no new requests.

    `on_drain` callbacks run once, in the signal handler (on the event loop's thread): the
    dispatcher uses it to give queued requests their 503 before the drain deadline.
    `request_rolling_restart()` (SIGHUP to `up`) restarts every worker, one at a time.
    """

    draining: bool = False
    _on_drain: list[Callable[[], None]] = field(default_factory=list)
    _on_restart: list[Callable[[], None]] = field(default_factory=list)

    def on_drain(self, callback: Callable[[], None]) -> None:
        self._on_drain.append(callback)

    def on_rolling_restart(self, callback: Callable[[], None]) -> None:
        self._on_restart.append(callback)

    def request_rolling_restart(self) -> None:
        for callback in self._on_restart:
            callback()

    def start_draining(self) -> None:
        if self.draining:
            return
        self.draining = True
        for callback in self._on_drain:
            callback()


@dataclass(frozen=True, slots=True)
class GatewayContext:
    settings: GatewaySettings
    client: UpstreamClient
    registry: WorkerRegistry
    dispatcher: Dispatcher
    tenants: TenantDirectory
    cost_model: CostModel
    metrics: GatewayMetrics
    accounting: Accounting  # writes both, for every finished exchange
    media: MediaPolicy = field(default_factory=MediaPolicy)
    limits: RequestLimits = field(default_factory=RequestLimits)
    priority_header: bytes = b"x-priority"  # lower-cased, as ASGI gives header names
    document_header: bytes = b"x-document-id"  # lower-cased
    metrics_registry: CollectorRegistry = field(
        default_factory=lambda: CollectorRegistry(auto_describe=False)
    )
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    rolling: RollingRestart | None = None  # when the gateway runs its workers (`up`)
    results: ResultCache | None = None  # coalescing and the result cache (cache/), when on

    def lifespan_state(self) -> dict[str, Any]:
        """What the lifespan yields: ASGI copies it into every request's scope["state"]."""
        return {STATE_KEY: self}


def gateway_context(scope: Mapping[str, Any]) -> GatewayContext:
    """The app's context, from an ASGI scope (a raw endpoint's, or a Starlette request's)."""
    context = scope["state"][STATE_KEY]
    if not isinstance(context, GatewayContext):
        raise TypeError(f"scope state {STATE_KEY!r} holds {type(context).__name__}")
    return context
