"""What the edge (api/connection.py, entry/server.py) does with hostile or broken clients, on the
gateway's own server over real sockets (docs/http-edge.md): broken body framing answered 400
and the app told the client is gone, heads and bodies that stop coming timed out with 408,
a stray byte after an answer that cannot keep a connection forever, upgrade requests served
as HTTP/1.1 with their body, and no descriptor left behind."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from mineru_gateway.api.connection import Timeouts
from tests.support.raw_http import chunk, connect, content_length, exchange, until_closed
from tests.support.servers import GatewayServerThread, wait_until
from tests.support.workers import Script

pytestmark = pytest.mark.unit

SHORT = Timeouts(head_s=0.5, body_idle_s=0.5, keep_alive_s=1.0)
POST = b"POST /echo HTTP/1.1\r\nHost: x\r\n"
CHUNKED = POST + b"Transfer-Encoding: chunked\r\n\r\n"


class Recorder:
    """Reads each request's body to its end and answers its size (`/early`: answers first,
    then reads); records what the body's reading came to: its size, or `gone` when the
    server said the client had gone."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/early":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"early,", "more_body": True})
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.seen.append("gone")
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.seen.append(str(size))
        body = b"%d" % size
        if scope["path"] == "/early":
            await send({"type": "http.response.body", "body": body})
            return
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@contextmanager
def edge(timeouts: Timeouts = SHORT) -> Iterator[tuple[Recorder, GatewayServerThread]]:
    app = Recorder()
    thread = GatewayServerThread(app, timeouts)
    thread.start()
    try:
        yield app, thread
    finally:
        thread.stop()


def _error(answer: bytes) -> tuple[int, str, list[bytes]]:
    """Status, OpenAI error code and head lines of the one answer in `answer`."""
    head, body = answer.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    assert len(body) == content_length(head), answer
    return int(lines[0].split()[1]), json.loads(body)["error"]["code"], lines


def _answers(client: socket.socket, count: int = 1) -> list[bytes]:
    """The next `count` sized answers on a connection the server keeps open."""
    data, answers = b"", []
    while len(answers) < count:
        while b"\r\n\r\n" not in data:
            data += client.recv(65536) or _closed()
        head = data.split(b"\r\n\r\n", 1)[0]
        end = len(head) + 4 + content_length(head)
        while len(data) < end:
            data += client.recv(65536) or _closed()
        answers.append(data[:end])
        data = data[end:]
    return answers


def _closed() -> bytes:
    raise AssertionError("the server closed the connection")


# -- broken framing -----------------------------------------------------------------------------

# Body framing llhttp notices after the head is in: a request was made of it, its app is reading.
BROKEN_BODIES = {
    "chunk size overflows": CHUNKED + b"fffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
    "negative chunk size": CHUNKED + b"-5\r\nhello\r\n0\r\n\r\n",
    "0x chunk size": CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n",
    "missing chunk size": CHUNKED + b"\r\nhello\r\n0\r\n\r\n",
    "chunk without its CRLF": CHUNKED + b"5\r\nhelloXX0\r\n\r\n",
}
# Framing refused in the head: no request is made of it.
BROKEN_HEADS = {
    "unknown coding": POST + b"Transfer-Encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "chunked, then gzip": POST + b"Transfer-Encoding: chunked, gzip\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "gzip, then chunked": POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "Content-Length and chunked": POST
    + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "two Content-Lengths": POST + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
}


@pytest.mark.parametrize("request_bytes", BROKEN_BODIES.values(), ids=list(BROKEN_BODIES))
def test_a_broken_body_is_answered_400_and_its_app_told_the_client_is_gone(
    request_bytes: bytes,
) -> None:
    with edge() as (app, thread):
        answer = exchange(thread.url, request_bytes)
        wait_until(lambda: app.seen == ["gone"], 5, "the app told the client is gone")
    status, code, head = _error(answer)
    assert (status, code) == (400, "malformed_request")
    assert b"connection: close" in head and b"content-type: application/json" in head


@pytest.mark.parametrize("request_bytes", BROKEN_HEADS.values(), ids=list(BROKEN_HEADS))
def test_broken_framing_in_the_head_is_answered_400_before_any_request(
    request_bytes: bytes,
) -> None:
    with edge() as (app, thread):
        answer = exchange(thread.url, request_bytes)
    assert _error(answer)[:2] == (400, "malformed_request")
    assert app.seen == []


def test_a_body_that_breaks_after_the_answer_started_closes_the_connection() -> None:
    with edge() as (app, thread), connect(thread.url) as client:
        client.sendall(CHUNKED.replace(b"/echo", b"/early") + chunk(b"hello"))
        assert b"early," in client.recv(65536)
        client.sendall(b"zz\r\n")
        rest = until_closed(client)
        wait_until(lambda: app.seen == ["gone"], 5, "the app told the client is gone")
    assert b"400" not in rest and not rest.endswith(b"0\r\n\r\n")  # cut, not completed


def test_a_broken_pipelined_request_ends_the_connection_after_the_answer_before_it() -> None:
    good = POST + b"Content-Length: 2\r\n\r\nhi"
    with edge() as (app, thread):
        answer = exchange(thread.url, good + BROKEN_BODIES["negative chunk size"])
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.endswith(b"\r\n\r\n2")
    assert app.seen == ["2"]


# -- timeouts -----------------------------------------------------------------------------------


def test_a_head_trickled_a_byte_at_a_time_is_timed_out_408() -> None:
    head = b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    with edge() as (app, thread), connect(thread.url) as client:
        started = time.monotonic()
        with contextlib.suppress(ConnectionError):
            for byte in head:  # each byte well within any idle timeout
                client.sendall(bytes([byte]))
                time.sleep(0.05)
                if time.monotonic() - started > 10:
                    break
        answer = until_closed(client)
    assert _error(answer)[:2] == (408, "request_timeout")
    assert time.monotonic() - started < 10
    assert app.seen == []


def test_half_a_head_then_silence_is_timed_out_408() -> None:
    with edge() as (_, thread), connect(thread.url) as client:
        client.sendall(b"GET /echo HTTP/1.1\r\nHo")
        answer = until_closed(client)
    status, code, head = _error(answer)
    assert (status, code) == (408, "request_timeout") and b"connection: close" in head


def test_a_body_that_stops_half_way_is_timed_out_408_and_its_app_told() -> None:
    with edge() as (app, thread), connect(thread.url) as client:
        client.sendall(POST + b"Content-Length: 100\r\n\r\n" + b"x" * 50)
        answer = until_closed(client)
        wait_until(lambda: app.seen == ["gone"], 5, "the app told the client is gone")
    assert _error(answer)[:2] == (408, "request_timeout")


def test_a_body_that_keeps_coming_slower_than_the_head_timeout_is_not_cut() -> None:
    """The body's clock is the time between reads, not the whole body's."""
    with edge() as (app, thread), connect(thread.url) as client:
        client.sendall(CHUNKED)
        for _ in range(8):  # 8 x 0.2 s: past every timeout in all, each gap within them
            client.sendall(chunk(b"abcd"))
            time.sleep(0.2)
        client.sendall(b"0\r\n\r\n")
        assert _answers(client)[0].endswith(b"\r\n\r\n32")
    assert app.seen == ["32"]


def test_a_stray_byte_after_an_answer_is_timed_out_as_a_head() -> None:
    """One byte of a next request must not keep the connection open forever."""
    timeouts = Timeouts(head_s=0.5, body_idle_s=0.5, keep_alive_s=60)
    with edge(timeouts) as (_, thread), connect(thread.url) as client:
        client.sendall(POST + b"Content-Length: 2\r\n\r\nhi")
        assert _answers(client)[0].endswith(b"\r\n\r\n2")
        client.sendall(b"G")
        started = time.monotonic()
        answer = until_closed(client)
    assert _error(answer)[:2] == (408, "request_timeout")
    assert time.monotonic() - started < 5  # the head's timeout, not the keep-alive's 60 s


def test_a_client_told_to_continue_has_the_whole_body_timeout_from_then() -> None:
    """`Expect: 100-continue`: the client waits for the app to read; the body's clock starts
    when it is told to go on, not at its head."""
    with edge() as (app, thread), connect(thread.url) as client:
        client.sendall(CHUNKED.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
        assert client.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        time.sleep(0.3)
        client.sendall(chunk(b"abcd") + b"0\r\n\r\n")
        assert _answers(client)[0].endswith(b"\r\n\r\n4")
    assert app.seen == ["4"]


def test_slow_clients_leave_no_connection_or_descriptor_behind() -> None:
    """Slow heads, stopped bodies and stray bytes, 30 of each at once: all timed out, and the
    process holds what it held before."""

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    with edge() as (_, thread):
        url = thread.url
        with httpx.Client(base_url=url) as warm:
            warm.post("/echo", content=b"x")  # first-use allocations out of the count
        before = descriptors()
        clients = [connect(url) for _ in range(90)]
        try:
            for n, client in enumerate(clients):
                kind = n % 3
                if kind == 0:
                    client.sendall(b"GET /echo HTTP/1.1\r\nHo")
                elif kind == 1:
                    client.sendall(POST + b"Content-Length: 10\r\n\r\nhalf")
                else:
                    client.sendall(POST + b"Content-Length: 0\r\n\r\nG")
            wait_until(lambda: len(thread.server.edge.connections) == 90, 10, "all connected")
            for client in clients:
                until_closed(client)
        finally:
            for client in clients:
                client.close()
        wait_until(lambda: not thread.server.edge.connections, 10, "no connection left")
        wait_until(lambda: descriptors() <= before, 10, "the descriptors back where they were")
        assert not thread.server.edge.tasks


# -- upgrade requests ---------------------------------------------------------------------------

H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"


UPGRADE_BODIES = {
    "sized": b"Content-Length: 5\r\n\r\nhello",
    "chunked": b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("body", UPGRADE_BODIES.values(), ids=list(UPGRADE_BODIES))
def test_an_h2c_upgrade_post_is_served_as_http_1_1_with_its_body(body: bytes) -> None:
    """`curl --http2` asks to upgrade a POST: served as HTTP/1.1, body included, and the
    connection goes on serving the requests after it."""
    after = POST + b"Content-Length: 3\r\n\r\nabc"
    with edge() as (app, thread), connect(thread.url) as client:
        client.sendall(POST + H2C + body + after)
        first, second = _answers(client, 2)
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b"\r\n\r\n5")
    assert second.endswith(b"\r\n\r\n3")
    assert app.seen == ["5", "3"]


def test_upgrade_requests_through_the_gateway_are_served_plain(
    scripted: tuple[Script, str], start_gateway: Any
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker])
    body = json.dumps({"model": "echo-model", "messages": [{"role": "user", "content": "hi"}]})
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + H2C
        + b"Content-Length: %d\r\n\r\n" % len(body)
    )
    wait_until(lambda: httpx.get(gateway + "/ready").status_code == 200, 10, "ready")
    websocket = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    with connect(gateway) as client:
        client.sendall(head + body.encode())
        [chat] = _answers(client)
        client.sendall(websocket + b"Sec-WebSocket-Version: 13\r\n\r\n")
        [health] = _answers(client)
    assert chat.startswith(b"HTTP/1.1 200 OK\r\n"), chat
    assert health.startswith(b"HTTP/1.1 200 OK\r\n"), health
    assert [seen["size"] for seen in script.seen] == [len(body)]
