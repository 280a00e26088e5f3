"""State every replica of the gateway shares: tenants' in-flight slots in Redis, when
`MINERU_GATEWAY_FLEET_STATE` names one (docs/operate/fleet-state.md). Off, each process keeps
its own counts (flow.py), as a gateway on one box needs.
"""

from __future__ import annotations

from mineru_gateway.config import GatewaySettings
from mineru_gateway.fleet.slots import FleetSlots, Permit

__all__ = ["FleetSlots", "Permit", "build_fleet_slots"]


def build_fleet_slots(settings: GatewaySettings) -> FleetSlots | None:
    if settings.fleet_state == "off":
        return None
    return FleetSlots(
        settings.fleet_state,
        lease_s=settings.fleet_state_lease_s,
        timeout_s=settings.fleet_state_timeout_s,
        poll_s=settings.fleet_state_poll_s,
    )
