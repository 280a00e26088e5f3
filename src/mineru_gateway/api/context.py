"""What a request handler may use: built once per app in the lifespan, never a global."""

from __future__ import annotations

from dataclasses import dataclass

from mineru_gateway.config import GatewaySettings
from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.workers.registry import WorkerRegistry
from mineru_gateway.workers.upstream import UpstreamClient


@dataclass(frozen=True, slots=True)
class GatewayContext:
    settings: GatewaySettings
    client: UpstreamClient
    registry: WorkerRegistry
    metrics: GatewayMetrics
