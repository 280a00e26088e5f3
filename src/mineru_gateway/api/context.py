"""What a request handler may use: built once per app in the lifespan, never a global.

Handlers reach it through one typed accessor, `gateway_context(scope)`, never by string keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from mineru_gateway.config import GatewaySettings
from mineru_gateway.cost import CostModel
from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.workers.registry import WorkerRegistry
from mineru_gateway.workers.upstream import UpstreamClient

STATE_KEY = "gateway"


@dataclass(slots=True)
class Lifecycle:
    """Set by the server's signal handler: from then on the gateway admits no new requests."""

    draining: bool = False

    def start_draining(self) -> None:
        self.draining = True


@dataclass(frozen=True, slots=True)
class GatewayContext:
    settings: GatewaySettings
    client: UpstreamClient
    registry: WorkerRegistry
    cost_model: CostModel
    metrics: GatewayMetrics
    metrics_registry: CollectorRegistry = field(
        default_factory=lambda: CollectorRegistry(auto_describe=False)
    )
    lifecycle: Lifecycle = field(default_factory=Lifecycle)

    def lifespan_state(self) -> dict[str, Any]:
        """What the lifespan yields: ASGI copies it into every request's scope["state"]."""
        return {STATE_KEY: self}


def gateway_context(scope: Mapping[str, Any]) -> GatewayContext:
    """The app's context, from an ASGI scope (a raw endpoint's, or a Starlette request's)."""
    context = scope["state"][STATE_KEY]
    if not isinstance(context, GatewayContext):
        raise TypeError(f"scope state {STATE_KEY!r} holds {type(context).__name__}")
    return context
