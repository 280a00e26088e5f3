"""The gateway's server protocol and the client link it hands the relay (api/connection.py), on the
gateway's own server (entry/server.py): whole answers in one write that keep keep-alive,
`Connection: close` and pipelining, byte for byte what uvicorn's own protocol writes; a lost
connection reported once, also to a late caller; no link under uvicorn's own protocols; the
relay's disconnect handling, and large request bodies (in pieces, chunked, over the limit, after
`100 Continue`, pipelined, cut off), the same on both paths. What else the protocol took over
from uvicorn's: tests/api/test_server_protocol.py."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import httpx
import pytest

from mineru_gateway.api.app import create_app
from mineru_gateway.api.connection import ClientLink, GatewayHttpProtocol
from mineru_gateway.config import GatewaySettings
from tests.support.raw_http import chunk, connect, content_length, exchange
from tests.support.servers import serve, serve_gateway, wait_until
from tests.support.workers import Script

pytestmark = pytest.mark.unit


class LinkApp:
    """Answers every request through its link (the path in the body), or waits for the client
    to leave when the path is /wait (/late: notices the loss first, then asks to be told)."""

    def __init__(self) -> None:
        self.links: list[ClientLink | None] = []
        self.clients: list[Any] = []
        self.lost = threading.Event()
        self.lost_calls = 0
        self.late: list[bool] = []  # /late's answers: whether each went out

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        link = ClientLink.of(scope)
        self.links.append(link)
        self.clients.append(scope["client"])
        while (await receive()).get("more_body"):
            pass
        if link is None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"asgi"})
        elif scope["path"] == "/wait":
            gone = asyncio.Event()

            def on_lost() -> None:
                self._on_lost()
                gone.set()

            link.on_lost(on_lost)
            await gone.wait()  # and then ends, so the server stops without waiting on it
        elif scope["path"] == "/late":
            while not link.done:  # noqa: ASYNC110 - the loss has no event to wait on here
                await asyncio.sleep(0.01)
            link.on_lost(self._on_lost)
            await link.respond(200, [], b"too late")  # to no one: nothing written, no error
            self.late.append(link.complete)
        else:
            headers = [(b"content-type", b"text/plain"), (b"x-path", scope["path"].encode())]
            await link.respond(200, headers, scope["path"].encode())

    def _on_lost(self) -> None:
        self.lost_calls += 1
        self.lost.set()


def _serve(app: Any, http: Any) -> AbstractContextManager[str]:
    """`app` on the gateway's own server for `http=GatewayHttpProtocol`, else on uvicorn with
    its protocol `http`."""
    if http is GatewayHttpProtocol:
        return serve_gateway(app)
    return serve(app, http=http)


@contextmanager
def link_server(http: Any = GatewayHttpProtocol) -> Iterator[tuple[LinkApp, str]]:
    app = LinkApp()
    with _serve(app, http) as url:
        yield app, url


def test_whole_answers_through_the_link_keep_the_connection_alive() -> None:
    with link_server() as (app, url), httpx.Client(base_url=url) as client:
        answers = [client.post(f"/a{n}", content=b"x" * 10) for n in range(3)]
    assert [(a.status_code, a.text, a.headers["x-path"]) for a in answers] == [
        (200, f"/a{n}", f"/a{n}") for n in range(3)
    ]
    assert answers[0].headers["content-length"] == "3"
    assert "transfer-encoding" not in answers[0].headers
    assert answers[0].headers["server"] == "mineru-gateway"  # the server's default headers
    assert all(link is not None for link in app.links)
    assert len(set(map(tuple, app.clients))) == 1  # one connection for all three


def test_connection_close_is_honoured_and_pipelined_requests_answered_in_order() -> None:
    requests = (
        b"POST /first HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
        b"POST /second HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    with link_server() as (_, url):
        answer = exchange(url, requests)  # returns only because the server closed the connection
    first, second = answer.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert first.endswith(b"\r\n\r\n/first") and b"connection: close" not in first
    assert second.endswith(b"\r\n\r\n/second") and b"connection: close\r\n" in second


def test_a_lost_connection_is_reported_once_and_to_a_late_caller_at_once() -> None:
    with link_server() as (app, url):
        for path in ("/wait", "/late"):
            app.lost.clear()
            with connect(url) as client:
                client.sendall(
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode()
                )
                wait_until(lambda: len(app.links) > 0 and app.links[-1] is not None, 5, "request")
            assert app.lost.wait(5), path
        assert app.lost_calls == 2
        wait_until(lambda: app.late == [False], 5, "the late request answered to no one")


class SameAnswer:
    """One answer to every request: through the link where there is one, else through ASGI
    `send`, sized, as any app gives it."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"text/plain"), (b"x-one", b"1")]
        body = b"the same answer"
        link = ClientLink.of(scope)
        if link is not None:
            await link.respond(201, headers, body)
            return
        length = (b"content-length", b"%d" % len(body))
        await send({"type": "http.response.start", "status": 201, "headers": [*headers, length]})
        await send({"type": "http.response.body", "body": body})


def test_an_answer_through_the_link_is_byte_for_byte_what_uvicorns_send_writes() -> None:
    """`ClientLink.respond` writes a head as uvicorn's `send` does, in one write instead of two
    (but for the `server` header's value): if an uvicorn release changes its heads, this fails
    rather than the two drifting apart."""
    requests = (
        b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
        b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    answers = []
    for http in (GatewayHttpProtocol, "httptools"):
        with _serve(SameAnswer(), http) as url:
            answer = exchange(url, requests)
        answers.append(
            b"".join(
                line
                for line in answer.splitlines(keepends=True)
                if not line.startswith((b"date: ", b"server: "))
            )
        )
    through_link, through_send = answers
    assert through_link.count(b"HTTP/1.1 201 Created\r\n") == 2
    assert through_link.endswith(b"connection: close\r\n\r\nthe same answer")
    assert through_link == through_send


def test_uvicorns_own_protocol_makes_no_link() -> None:
    with link_server(http="httptools") as (app, url):
        assert httpx.post(url + "/a").text == "asgi"
    assert app.links == [None]


@pytest.mark.parametrize("http", [GatewayHttpProtocol, "httptools"], ids=["link", "asgi"])
def test_a_client_leaving_cancels_the_worker_request_on_either_path(
    scripted: tuple[Script, str], http: Any
) -> None:
    script, worker = scripted
    script.mode = "hang"
    with _gateway(worker, http) as gateway:
        body = {"model": "echo-model", "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                gateway + "/v1/chat/completions", json=body, timeout=httpx.Timeout(5, read=0.3)
            )
        wait_until(lambda: script.cancelled == 1, 10, "the worker request cancelled")
        in_flight = lambda: httpx.get(gateway + "/v1/workers").json()["workers"][0]["in_flight"]  # noqa: E731
        wait_until(lambda: in_flight() == 0, 10, "in-flight released")


def test_the_gateways_requests_leave_no_reference_cycles(
    scripted: tuple[Script, str], start_gateway: Any
) -> None:
    """Each request's objects must be freed by reference counting: a cycle per request (the
    link and its cycle's scope once held each other) left them to the cyclic collector, whose
    collections cost more CPU than the link saved."""
    _, worker = scripted
    gateway = start_gateway([worker])
    body = {"model": "echo-model", "messages": [{"role": "user", "content": "hi"}]}
    ours = {"ClientLink", "Exchange", "ClientAnswer", "AnswerClock", "Answer", "Lease", "Grant"}
    with httpx.Client(base_url=gateway) as client:
        client.post("/v1/chat/completions", json=body)  # warm: first-use caches
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for stream in (False, True) * 10:
                answer = client.post("/v1/chat/completions", json=body | {"stream": stream})
                assert answer.status_code == 200
            gc.collect()
            cyclic = {type(thing).__qualname__ for thing in gc.garbage} & ours
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert cyclic == set()


@contextmanager
def _gateway(worker: str, http: Any, **settings: Any) -> Iterator[str]:
    """The gateway over `worker` on a real server (`_serve`), once it is ready."""
    app = create_app(GatewaySettings(workers=[worker], port=0, health_interval_s=0.2, **settings))
    with _serve(app, http) as gateway:
        wait_until(lambda: httpx.get(gateway + "/ready").status_code == 200, 10, "ready")
        yield gateway


def _chat(padding: int) -> bytes:
    """A chat request of about `padding` bytes, as a page image makes them."""
    body = {"model": "echo-model", "messages": [{"role": "user", "content": "x" * padding}]}
    return json.dumps(body).encode()


def _post_head(length: int | None, extra: str = "") -> bytes:
    size = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{size}\r\n{extra}\r\n"
    return head.encode()


def _answers(client: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """The next `count` answers on `client` (sized bodies): status and body of each."""
    buffer, answers = b"", []
    while len(answers) < count:
        while b"\r\n\r\n" not in buffer:
            buffer += client.recv(65536) or _closed()
        head, buffer = buffer.split(b"\r\n\r\n", 1)
        status = int(head.split(b" ", 2)[1])
        if status == 100:
            answers.append((100, b""))
            continue
        length = content_length(head)
        while len(buffer) < length:
            buffer += client.recv(65536) or _closed()
        answers.append((status, buffer[:length]))
        buffer = buffer[length:]
    return answers


def _closed() -> bytes:
    raise AssertionError("the gateway closed the connection")


@pytest.mark.parametrize("http", [GatewayHttpProtocol, "httptools"], ids=["link", "asgi"])
def test_a_large_body_sent_in_pieces_reaches_the_worker_whole(
    scripted: tuple[Script, str], http: Any
) -> None:
    """400 KB arriving over many reads and pauses, then a second request on the same
    connection: both reach the worker byte for byte."""
    script, worker = scripted
    body = _chat(400_000)
    with _gateway(worker, http) as gateway, connect(gateway) as client:
        client.sendall(_post_head(len(body)))
        for start in range(0, len(body), 50_000):
            client.sendall(body[start : start + 50_000])
            time.sleep(0.01)
        client.sendall(_post_head(len(body)) + body)
        answers = _answers(client, 2)
    assert [status for status, _ in answers] == [200, 200]
    digest = hashlib.sha256(body).hexdigest()
    assert [(seen["size"], seen["sha256"]) for seen in script.seen] == [(len(body), digest)] * 2


@pytest.mark.parametrize("http", [GatewayHttpProtocol, "httptools"], ids=["link", "asgi"])
def test_a_chunked_body_is_taken_up_to_the_limit_and_refused_past_it(
    scripted: tuple[Script, str], http: Any
) -> None:
    """No Content-Length to refuse up front: the body is counted as it arrives, all at once or
    in pieces while the relay waits for it. Within the limit it is relayed; past it, 413 in
    OpenAI's form and nothing sent to the worker; the connection still serves the next
    request."""
    script, worker = scripted
    small, large = _chat(20_000), _chat(150_000)

    def send_chunked(client: socket.socket, data: bytes, pause_s: float) -> None:
        client.sendall(_post_head(None))
        for start in range(0, len(data), 30_000):
            piece = data[start : start + 30_000]
            client.sendall(chunk(piece))
            time.sleep(pause_s)
        client.sendall(b"0\r\n\r\n")

    with _gateway(worker, http, max_body_bytes=100_000) as gateway, connect(gateway) as client:
        for pause_s in (0.0, 0.05):
            send_chunked(client, small, pause_s)
            [(status, _)] = _answers(client, 1)
            assert status == 200
            send_chunked(client, large, pause_s)
            [(status, answer)] = _answers(client, 1)
            assert status == 413
            assert json.loads(answer)["error"]["code"] == "request_too_large"
        client.sendall(_post_head(len(small)) + small)
        [(status, _)] = _answers(client, 1)
        assert status == 200
    assert [seen["size"] for seen in script.seen] == [len(small)] * 3


@pytest.mark.parametrize("http", [GatewayHttpProtocol, "httptools"], ids=["link", "asgi"])
def test_a_chunked_body_past_the_limit_in_the_heads_write_is_refused(
    scripted: tuple[Script, str], http: Any
) -> None:
    """All of it in one read with its head, so complete before the relay looks: still counted
    against the limit."""
    script, worker = scripted
    large, small = _chat(20_000), _chat(2_000)
    with _gateway(worker, http, max_body_bytes=10_000) as gateway, connect(gateway) as client:
        client.sendall(_post_head(None) + chunk(large) + b"0\r\n\r\n")
        [(status, answer)] = _answers(client, 1)
        client.sendall(_post_head(None) + chunk(small) + b"0\r\n\r\n")
        [(after, _)] = _answers(client, 1)  # the connection serves the next request
    assert status == 413 and json.loads(answer)["error"]["code"] == "request_too_large"
    assert after == 200 and [seen["size"] for seen in script.seen] == [len(small)]


@pytest.mark.parametrize("http", [GatewayHttpProtocol, "httptools"], ids=["link", "asgi"])
def test_the_body_follows_100_continue(scripted: tuple[Script, str], http: Any) -> None:
    """A client that asks first (`Expect: 100-continue`, as curl does for large bodies) is
    told to go on, and its body then relayed."""
    script, worker = scripted
    body = _chat(200_000)
    with _gateway(worker, http) as gateway, connect(gateway) as client:
        client.sendall(_post_head(len(body), "Expect: 100-continue\r\n"))
        assert _answers(client, 1) == [(100, b"")]
        client.sendall(body)
        [(status, _)] = _answers(client, 1)
    assert status == 200
    assert [seen["size"] for seen in script.seen] == [len(body)]


@pytest.mark.parametrize("http", [GatewayHttpProtocol, "httptools"], ids=["link", "asgi"])
def test_a_client_leaving_mid_body_sends_nothing_to_the_worker(
    scripted: tuple[Script, str], http: Any
) -> None:
    script, worker = scripted
    body = _chat(300_000)
    with _gateway(worker, http) as gateway:
        with connect(gateway) as client:
            client.sendall(_post_head(len(body)) + body[:100_000])
            time.sleep(0.2)

        def counted() -> bool:
            text = httpx.get(gateway + "/metrics").text
            return 'outcome="client_disconnected"' in text

        wait_until(counted, 10, "the request counted as the client's leaving")
        assert httpx.get(gateway + "/v1/workers").json()["workers"][0]["in_flight"] == 0
    assert script.seen == []


def test_pipelined_requests_with_bodies_are_answered_in_order(
    scripted: tuple[Script, str],
) -> None:
    script, worker = scripted
    bodies = [_chat(size) for size in (100_000, 10, 70_000)]
    with _gateway(worker, GatewayHttpProtocol) as gateway, connect(gateway) as client:
        client.sendall(b"".join(_post_head(len(body)) + body for body in bodies))
        answers = _answers(client, 3)
    assert [status for status, _ in answers] == [200, 200, 200]
    assert [seen["size"] for seen in script.seen] == [len(body) for body in bodies]
