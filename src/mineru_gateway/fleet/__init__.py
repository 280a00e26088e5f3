"""State every replica of the gateway shares in Redis, when `MINERU_GATEWAY_FLEET_STATE` names
one (docs/operate/fleet-state.md): tenants' in-flight slots (slots.py), and each replica's counts
of its tenants' queued and in-flight requests, for their queue limits and fair shares (tenants.py).
Off, each replica keeps its own counts (flow.py), as a gateway of one replica needs.
"""

from __future__ import annotations

from mineru_gateway.config import GatewaySettings
from mineru_gateway.fleet.slots import FleetSlots, Permit
from mineru_gateway.fleet.tenants import FleetTenants, replica_id

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
) -> FleetTenants | None:
    """With fleet state on: the other replicas' counts of each tenant."""
    if slots is None:
        return None
    return FleetTenants(
        settings.fleet_state,
        replica=replica_id(),
        share_s=settings.fleet_state_share_s,
        timeout_s=settings.fleet_state_timeout_s,
        metrics=slots.metrics,  # one count of fallbacks for fleet state
    )
