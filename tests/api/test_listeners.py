"""Listeners besides the client port: `/metrics` on one of its own (issue 14), so tenants on the
client port cannot read it."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from mineru_gateway.api.listeners import Listener, metrics_app
from mineru_gateway.testing import free_port
from tests.conftest import StartGateway
from tests.support.workers import Script

BODY = {"model": "echo-model", "messages": [{"role": "user", "content": "hi"}]}


def test_with_a_metrics_port_metrics_leave_the_client_port(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    _, worker = scripted
    port = free_port()
    gateway = start_gateway([worker], metrics_port=port)
    assert httpx.post(gateway + "/v1/chat/completions", json=BODY).status_code == 200
    hidden = httpx.get(gateway + "/metrics")
    assert hidden.status_code == 404
    assert hidden.json()["error"]["code"] == "not_found"
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "mineru_gateway_requests_total{" in metrics.text
    assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 404
    assert httpx.head(f"http://127.0.0.1:{port}/metrics").status_code == 200


def render(registry: CollectorRegistry) -> Callable[[], Awaitable[bytes]]:
    async def rendered() -> bytes:
        return generate_latest(registry)

    return rendered


async def test_the_listener_serves_its_registry_and_stops() -> None:
    registry = CollectorRegistry()
    Counter("probe_events", "a test counter", registry=registry).inc(3)
    listener = Listener(metrics_app(render(registry)))
    await listener.start()
    url = f"http://127.0.0.1:{listener.port}/metrics"
    async with httpx.AsyncClient() as client:
        assert "probe_events_total 3.0" in (await client.get(url)).text
    await listener.stop()
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(url)


async def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        listener = Listener(metrics_app(render(CollectorRegistry())), port=port)
        with pytest.raises(OSError, match=f"could not listen on 127.0.0.1:{port}"):
            await listener.start()
