"""What a request handler may use: built once per app in the lifespan, never a global."""

from __future__ import annotations

from dataclasses import dataclass, field

from mineru_gateway.config import GatewaySettings
from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.workers.registry import WorkerRegistry
from mineru_gateway.workers.upstream import UpstreamClient


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
    metrics: GatewayMetrics
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
