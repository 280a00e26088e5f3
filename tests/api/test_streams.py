"""Streamed answers relayed whole and in order: through the gateway's own protocol, across a
client that stops reading (backpressure to the worker), and under uvicorn's own protocols."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from mineru_gateway.api.app import create_app
from mineru_gateway.config import GatewaySettings
from tests.conftest import StartGateway
from tests.support.servers import serve, wait_until
from tests.support.workers import Script, flood_event

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"
BODY = {"model": "echo-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def _expected(events: int) -> bytes:
    return b"".join(flood_event(n) for n in range(events)) + b"data: [DONE]\n\n"


def test_a_stream_arrives_whole(scripted: tuple[Script, str], start_gateway: StartGateway) -> None:
    script, worker = scripted
    script.mode, script.events = "flood", 5000
    gateway = start_gateway([worker])
    with httpx.stream("POST", gateway + CHAT, json=BODY) as response:
        received = b"".join(response.iter_raw())
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert received == _expected(5000)


def test_a_client_that_stops_reading_still_gets_every_event_in_order(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    """8 MB through a 4 KB receive buffer, the client silent for a second: the gateway's writes
    back up, reading from the worker pauses, and resumes when the client reads."""
    script, worker = scripted
    script.mode, script.events = "flood", 50_000
    gateway = urlsplit(start_gateway([worker]))
    body = orjson.dumps(BODY)
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {gateway.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.settimeout(60)
        client.connect((gateway.hostname, gateway.port))
        client.sendall(head.encode() + body)
        time.sleep(1.0)
        answer = bytearray()
        while data := client.recv(1 << 16):
            answer += data
    status_line, _, rest = bytes(answer).partition(b"\r\n")
    assert status_line == b"HTTP/1.1 200 OK"
    headers, _, chunked = rest.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in headers.lower()
    assert _dechunk(chunked) == _expected(50_000)


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_uvicorns_own_protocols_relay_streams_too(scripted: tuple[Script, str], http: str) -> None:
    """Without the gateway's protocol there is no client link: the relay's plain ASGI path."""
    script, worker = scripted
    script.mode, script.events = "flood", 500
    app = create_app(GatewaySettings(workers=[worker], port=0, health_interval_s=0.2))
    with serve(app, http=http) as gateway:
        wait_until(lambda: httpx.get(gateway + "/ready").status_code == 200, 10, "ready")
        with httpx.stream("POST", gateway + CHAT, json=BODY) as response:
            received = b"".join(response.iter_raw())
        assert received == _expected(500)


def _dechunk(data: bytes) -> bytes:
    body, position = bytearray(), 0
    while True:
        end = data.index(b"\r\n", position)
        size = int(data[position:end], 16)
        if size == 0:
            return bytes(body)
        body += data[end + 2 : end + 2 + size]
        position = end + 2 + size + 2
