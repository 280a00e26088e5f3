"""The gateway's HTTP/1.1 server protocol (api/connection.py) on the gateway's own server
(entry/server.py): what it took over from uvicorn's protocol besides the link
(tests/api/test_connection.py): the idle keep-alive timeout, malformed and upgrade requests,
HTTP/1.0, HEAD, chunked answers, an app that fails or answers nothing, the graceful shutdown.
What hostile clients get: tests/api/test_hostile_clients.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from mineru_gateway.api.connection import MAX_HEAD_BYTES, Timeouts
from tests.support.raw_http import connect, exchange, until_closed
from tests.support.servers import GatewayServerThread, serve_gateway, wait_until

pytestmark = pytest.mark.unit

MISUSES: dict[str, list[dict[str, Any]]] = {
    # path: the messages sent, the last of which `send` refuses
    "/body-first": [{"type": "http.response.body", "body": b"x"}],
    "/bad-name": [{"type": "http.response.start", "status": 200, "headers": [(b"a b", b"1")]}],
    "/bad-value": [{"type": "http.response.start", "status": 200, "headers": [(b"a", b"\n")]}],
    "/too-long": [
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]},
        {"type": "http.response.body", "body": b"abc"},
    ],
    "/too-short": [
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]},
        {"type": "http.response.body", "body": b"ab"},
    ],
    "/start-twice": [
        {"type": "http.response.start", "status": 200, "headers": []},
        {"type": "http.response.start", "status": 200, "headers": []},
    ],
}


class App:
    """By path: /boom fails before answering, /boom-late after the head, /nothing returns
    without answering, /half returns after the head, /stream answers in chunked framing, /wait
    answers after a while, /after sends once more after its answer, MISUSES' paths send what
    `send` refuses; any other path is echoed, sized. `refused` holds what `send` raised."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        path = scope["path"]
        if path in MISUSES:
            try:
                for message in MISUSES[path]:
                    await send(message)
            except RuntimeError as error:
                self.refused.append(str(error))
                raise
        if path == "/half":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            return
        if path == "/boom":
            raise RuntimeError("before the answer")
        if path == "/nothing":
            return
        if path == "/wait":
            await asyncio.sleep(0.5)
        if path in ("/stream", "/boom-late"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"one,", "more_body": True})
            if path == "/boom-late":
                raise RuntimeError("mid-answer")
            await send({"type": "http.response.body", "body": b"two", "more_body": False})
            return
        body = f"{scope['method']} {path} {scope['http_version']}".encode()
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        if path == "/after":
            try:
                await send({"type": "http.response.body", "body": b"more"})
            except RuntimeError as error:
                self.refused.append(str(error))


@contextmanager
def server(app: App | None = None, **timeouts: float) -> Iterator[str]:
    with serve_gateway(app or App(), timeouts=Timeouts(**timeouts)) as url:
        yield url


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout() -> None:
    with server(keep_alive_s=0.5) as url, connect(url) as client:
        for _ in range(3):  # answers within the timeout keep it open
            client.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(65536).endswith(b"GET /a 1.1")
            time.sleep(0.3)
        started = time.monotonic()
        assert until_closed(client) == b""
        assert 0.1 < time.monotonic() - started < 3


def test_a_connection_that_never_sends_is_closed_after_the_keep_alive_timeout() -> None:
    with server(keep_alive_s=0.3) as url, connect(url) as client:
        assert until_closed(client) == b""


def test_a_request_longer_than_the_keep_alive_timeout_is_answered() -> None:
    with server(keep_alive_s=0.2) as url, connect(url) as client:
        client.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        assert client.recv(65536).endswith(b"GET /wait 1.1")


def test_a_malformed_request_is_answered_400_and_the_connection_closed() -> None:
    with server() as url:
        answer = exchange(url, b"NOT HTTP AT ALL\r\n\r\n")
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"connection: close" in head.split(b"\r\n")
    assert json.loads(body)["error"]["code"] == "malformed_request"


def test_a_head_that_never_ends_is_refused_431_once_past_its_cap() -> None:
    """The app refuses headers past 32 KiB once a head is complete; a head that goes on is
    refused by the protocol at 1 MiB, before it ends, in the same OpenAI form."""
    with server() as url, connect(url) as client:
        client.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\nX-Flood: ")
        sent = 0
        with contextlib.suppress(ConnectionError):  # the server stops reading and closes
            while sent < 4 * MAX_HEAD_BYTES:
                client.sendall(b"a" * 65536)
                sent += 65536
        answer = until_closed(client)
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert b"connection: close" in head.split(b"\r\n")
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


def test_a_malformed_request_after_a_good_one_ends_the_connection_after_its_answer() -> None:
    with server() as url:
        answer = exchange(url, b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\nNOT HTTP\r\n\r\n")
    assert answer.count(b"HTTP/1.1 ") == 1
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"GET /wait 1.1")
    assert b"connection: close\r\n" in answer


def test_an_upgrade_request_is_served_as_a_plain_one_and_the_connection_kept() -> None:
    request = b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    with server() as url:
        answer = exchange(
            url, request + b"GET /next HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
    first, second = answer.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert first.endswith(b"GET /ws 1.1") and second.endswith(b"GET /next 1.1")


def test_http_1_0_is_answered_and_the_connection_closed() -> None:
    with server() as url:
        answer = exchange(url, b"GET /old HTTP/1.0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"GET /old 1.0")
    assert b"connection: close\r\n" in answer


def test_head_gets_the_head_without_the_body() -> None:
    with server() as url, connect(url) as client:
        client.sendall(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\nGET /g HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"GET /g 1.1"):
            answer += client.recv(65536)
    head, rest = answer.split(b"\r\n\r\n", 1)
    assert b"content-length: 11" in head.split(b"\r\n")  # as the app gave it: "HEAD /h 1.1"
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n") and rest.endswith(b"GET /g 1.1")


def test_an_answer_without_a_length_goes_in_chunked_framing() -> None:
    with server() as url:
        answer = httpx.get(url + "/stream")
    assert answer.text == "one,two"
    assert answer.headers["transfer-encoding"] == "chunked"


def test_an_app_failing_before_its_answer_gives_a_plain_500_and_a_closed_connection() -> None:
    for path in ("/boom", "/nothing"):
        with server() as url:
            answer = exchange(url, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n"), path
        assert b"connection: close\r\n" in answer
        assert answer.endswith(b"\r\n\r\nInternal Server Error")


def test_an_app_failing_mid_answer_closes_the_connection() -> None:
    with server() as url:
        answer = exchange(url, b"GET /boom-late HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"\r\n4\r\none,\r\n")  # no last chunk: the client sees it cut


@pytest.mark.parametrize("path", list(MISUSES))
def test_what_uvicorns_send_refuses_is_refused(path: str) -> None:
    """Refused before the head went out: a plain 500; after it: the connection closed."""
    app = App()
    with server(app) as url:
        answer = exchange(url, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert len(app.refused) == 1
    if MISUSES[path][0]["type"] == "http.response.start" and len(MISUSES[path]) > 1:
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b" 500 " not in answer
    else:
        assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")


def test_an_app_returning_after_the_head_alone_closes_the_connection() -> None:
    with server() as url:
        answer = exchange(url, b"GET /half HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"transfer-encoding: chunked\r\n\r\n")  # and no body


def test_a_message_after_the_answer_is_refused_and_the_connection_goes_on() -> None:
    app = App()
    with server(app) as url, httpx.Client(base_url=url) as client:
        assert client.get("/after").text == "GET /after 1.1"
        assert client.get("/a%20b").text == "GET /a b 1.1"  # percent-decoded, as uvicorn does
    assert app.refused == ["unexpected ASGI message 'http.response.body' after the answer"]


def test_shutdown_closes_idle_connections_at_once_and_busy_ones_after_their_answer() -> None:
    thread = GatewayServerThread(App(), Timeouts(keep_alive_s=60))
    url = thread.start()
    with connect(url) as idle, connect(url) as busy:
        idle.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(65536).endswith(b"GET /a 1.1")
        busy.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        started = time.monotonic()
        thread.server.should_exit = True
        assert until_closed(idle) == b""
        assert time.monotonic() - started < 5  # not the keep-alive timeout's 60 s
        answer = until_closed(busy)
        thread.thread.join(timeout=10)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"GET /wait 1.1")
    assert b"connection: close\r\n" in answer


def test_shutdown_lets_a_request_whose_body_is_on_its_way_finish() -> None:
    thread = GatewayServerThread(App())
    url = thread.start()
    with connect(url) as client:
        client.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
        time.sleep(0.1)
        thread.server.should_exit = True
        time.sleep(0.2)
        client.sendall(b"67890")
        answer = until_closed(client)
        thread.thread.join(timeout=10)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"POST /upload 1.1")
    assert b"connection: close\r\n" in answer


def test_the_server_counts_answered_requests() -> None:
    thread = GatewayServerThread(App())
    url = thread.start()
    try:
        with httpx.Client(base_url=url) as client:
            for _ in range(3):
                client.get("/a")
        wait_until(lambda: thread.server.edge.total_requests == 3, 5, "3 requests")
    finally:
        thread.stop()
