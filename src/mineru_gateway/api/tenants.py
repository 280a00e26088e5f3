"""Who a request is: API keys to tenants, and the keys the gateway accepts
(docs/flow-control.md).

- Named tenants (settings `tenants` / `tenants_file`) own their keys, weight, default priority
  and limits.
- Every other accepted API key (`api_keys`) is a tenant of its own, with equal weight and the
  `tenant_*` default limits, named `key-<8 hex digits of its SHA-256>`: no configuration needed,
  and the key itself never reaches a label or a log.
- Without any keys, everything is one tenant, `default`: a single user sees no fairness at work.

Names are bounded by the configuration, so they are safe as metric labels.
"""

from __future__ import annotations

import hashlib

from mineru_gateway.api.auth import bearer_match
from mineru_gateway.config import Credentials, GatewaySettings
from mineru_gateway.errors import AuthenticationFailed
from mineru_gateway.flow import TenantPolicy

DEFAULT_TENANT = "default"


class TenantDirectory:
    """Keys to tenants, rebuilt whole by `refresh` when the key files or the tenants file change
    (reload.py): a request keeps the TenantPolicy it authenticated with."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._settings = settings
        self.default = self._policy(DEFAULT_TENANT)
        self._by_key = self._table(settings.credentials)

    def refresh(self) -> None:
        """Takes the settings' current credentials; one assignment, so `authenticate` sees the
        old table or the new one."""
        self._by_key = self._table(self._settings.credentials)

    def _policy(self, name: str) -> TenantPolicy:
        settings = self._settings
        return TenantPolicy(
            name,
            max_queued=settings.tenant_max_queued,
            max_queued_bytes=settings.tenant_max_queued_bytes,
            max_in_flight=settings.tenant_max_in_flight,
        )

    def _table(self, credentials: Credentials) -> dict[bytes, TenantPolicy]:
        settings = self._settings
        by_key: dict[bytes, TenantPolicy] = {}
        for key in credentials.client_keys:
            by_key[key.encode()] = self._policy(_key_name(key))
        for name, config in credentials.tenant_configs.items():
            named = TenantPolicy(
                name,
                weight=config.weight,
                priority=config.priority,
                min_priority=config.min_priority,
                max_queued=_either(config.max_queued, settings.tenant_max_queued),
                max_queued_bytes=_either(config.max_queued_bytes, settings.tenant_max_queued_bytes),
                max_in_flight=_either(config.max_in_flight, settings.tenant_max_in_flight),
            )
            for key in credentials.tenant_keys[name]:
                by_key[key.encode()] = named
        return by_key

    @property
    def keys_required(self) -> bool:
        return bool(self._by_key)

    def policies(self) -> dict[str, TenantPolicy]:
        known = {policy.name: policy for policy in self._by_key.values()}
        return known if known else {self.default.name: self.default}

    def priority_label(self, priority: int) -> str:
        """Clients choose priorities freely: only the configured ones (and 0) become labels."""
        known = {0} | {p.priority for p in self.policies().values()}
        known |= {p.min_priority for p in self.policies().values() if p.min_priority is not None}
        return str(priority) if priority in known else "other"

    def authenticate(self, authorization: bytes | None) -> TenantPolicy:
        """The tenant whose key `authorization` bears (`Bearer <key>`); the default tenant when
        the gateway checks no keys. Raises AuthenticationFailed."""
        by_key = self._by_key
        if not by_key:
            return self.default
        found = bearer_match(authorization, by_key.items())
        if found is None:
            raise AuthenticationFailed("missing or invalid API key (Authorization: Bearer <key>)")
        return found


def _key_name(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _either(own: int | None, default: int | None) -> int | None:
    return own if own is not None else default
