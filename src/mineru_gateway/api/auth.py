"""What the workers are told about the client: keys never reach logs or workers.

Checking the client's key is the tenant directory's (api/tenants.py): a key names a tenant.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import TypeVar

from mineru_gateway.config import GatewaySettings

T = TypeVar("T")


def bearer_match(authorization: bytes | None, keys: Iterable[tuple[bytes, T]]) -> T | None:
    """What the key in `Authorization: Bearer <key>` stands for among `keys` (key, value), or
    None. Every key is compared in constant time, all of them, so timing tells nothing about
    which one matched."""
    scheme, _, token = (authorization or b"").partition(b" ")
    given = token.strip()
    found: T | None = None
    for key, value in keys:
        if hmac.compare_digest(given, key) and scheme.lower() == b"bearer":
            found = value
    return found


def upstream_authorization(
    settings: GatewaySettings, client_header: bytes | None, keys_required: bool
) -> str | None:
    """What the worker gets: its own key if one is set; the client's header only when the
    gateway itself checks no keys (so a gateway key is never handed to a worker)."""
    if settings.worker_api_key:
        return f"Bearer {settings.worker_api_key}"
    if client_header and not keys_required:
        return client_header.decode("latin-1")
    return None
