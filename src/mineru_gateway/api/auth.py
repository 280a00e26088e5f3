"""API keys: who may use /v1/*. Checked in constant time; keys never reach logs or workers."""

from __future__ import annotations

import hmac

from mineru_gateway.config import GatewaySettings
from mineru_gateway.errors import AuthenticationFailed


def check_api_key(settings: GatewaySettings, authorization: bytes | None) -> None:
    """Raises AuthenticationFailed unless keys are off or `authorization` bears a valid one."""
    if not settings.api_keys:
        return
    scheme, _, token = (authorization or b"").decode("latin-1").partition(" ")
    if scheme.lower() == "bearer" and any(
        hmac.compare_digest(token.strip().encode(), key.encode()) for key in settings.api_keys
    ):
        return
    raise AuthenticationFailed("missing or invalid API key (Authorization: Bearer <key>)")


def upstream_authorization(settings: GatewaySettings, client_header: bytes | None) -> str | None:
    """What the worker gets: its own key if one is set; the client's header only when the
    gateway itself checks no keys (so a gateway key is never handed to a worker)."""
    if settings.worker_api_key:
        return f"Bearer {settings.worker_api_key}"
    if client_header and not settings.api_keys:
        return client_header.decode("latin-1")
    return None
