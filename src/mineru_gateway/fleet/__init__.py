"""State every replica of the gateway shares in Redis, when `MINERU_GATEWAY_FLEET_STATE` names
one (docs/operate/fleet-state.md): tenants' in-flight slots (slots.py), and each process's counts
of its tenants' queued and in-flight requests, for their queue limits and fair shares (tenants.py).
Off, each process keeps its own counts (flow.py), as a gateway on one box needs.
"""

from __future__ import annotations

from mineru_gateway.config import GatewaySettings
from mineru_gateway.fleet.slots import FleetSlots, Permit
from mineru_gateway.fleet.tenants import FleetTenants, replica_id
from mineru_gateway.flow import TenantsElsewhere

__all__ = ["FleetSlots", "FleetTenants", "Permit", "build_fleet_slots", "build_fleet_tenants"]


def build_fleet_slots(settings: GatewaySettings) -> FleetSlots | None:
    if settings.fleet_state == "off":
        return None
    return FleetSlots(
        settings.fleet_state,
        lease_s=settings.fleet_state_lease_s,
        timeout_s=settings.fleet_state_timeout_s,
        poll_s=settings.fleet_state_poll_s,
    )


def build_fleet_tenants(
    settings: GatewaySettings,
    slots: FleetSlots | None,
    local: TenantsElsewhere | None = None,
    directory: str | None = None,
    process: int = 0,
) -> FleetTenants | None:
    """With fleet state on: the other replicas' counts added to `local` (this replica's other
    processes, whose shared `directory` names the replica, and this one's index `process`)."""
    if slots is None:
        return None
    return FleetTenants(
        settings.fleet_state,
        local,
        replica=replica_id(directory),
        process=process,
        share_s=settings.fleet_state_share_s,
        timeout_s=settings.fleet_state_timeout_s,
        metrics=slots.metrics,  # one count of fallbacks for fleet state
    )
