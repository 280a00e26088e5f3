"""What a worker is told of the client's credentials: its own key, or the client's header only when
the gateway checks no keys itself, so that a gateway key never reaches a worker."""

from __future__ import annotations

import pytest

from mineru_gateway.api.auth import upstream_authorization
from mineru_gateway.config import GatewaySettings

pytestmark = pytest.mark.unit

CLIENT = b"Bearer client-key"


@pytest.mark.parametrize(
    ("worker_api_key", "client_header", "keys_required", "expected"),
    [
        ("worker-key", CLIENT, True, "Bearer worker-key"),
        ("worker-key", CLIENT, False, "Bearer worker-key"),
        ("worker-key", None, False, "Bearer worker-key"),
        (None, CLIENT, False, "Bearer client-key"),
        (None, CLIENT, True, None),
        (None, None, False, None),
        (None, b"", False, None),
        (None, b"Bearer k\xe9y", False, "Bearer k\xe9y"),  # header bytes are latin-1
    ],
)
def test_the_worker_gets_its_own_key_or_the_clients_header_when_no_keys_are_checked(
    worker_api_key: str | None,
    client_header: bytes | None,
    keys_required: bool,
    expected: str | None,
) -> None:
    settings = GatewaySettings(worker_api_key=worker_api_key)
    assert upstream_authorization(settings, client_header, keys_required) == expected
