"""The gateway's HTTP/1.1 server protocol, and the client's connection as the relay sees it.

`GatewayHttpProtocol` serves HTTP/1.1 over httptools (llhttp) and hands every request a
`ClientLink`: the request's ASGI `receive` and `send` and, in its scope's extensions, what the
relay uses below them: a callback for the connection's loss (called from `connection_lost`, no
task parked in `receive`) and a whole answer's head and body in one write (`respond`). One
object is the request's cycle and its link; the keep-alive timer is armed once per idle spell.

What it does (docs/http-edge.md lists it with the tests that hold it):

- keep-alive (HTTP/1.1 unless `Connection: close`; HTTP/1.0 closes), and the idle connection
  closed after the server's keep-alive timeout;
- pipelined requests answered in order, one at a time, reading paused while one waits;
- flow control both ways (`ConnectionFlow`): reading pauses while a request's unread body is
  past 64 KiB, writing waits while the transport's buffer is full;
- `Expect: 100-continue` answered when the app first reads the body;
- a malformed request answered 400 and the connection closed; an upgrade request (WebSocket)
  served as a plain request, its connection closed after the answer;
- a head that goes on past MAX_HEAD_BYTES refused (431 in OpenAI's form) before it ends; the
  400 and the 431 end with a lingering close (`_refuse`), so a client still sending reads them;
- the server's default headers (`date`, `server`), and the graceful shutdown: idle
  connections close at once, busy ones after their answer;
- an app that fails before answering gets a plain 500, one that fails mid-answer a closed
  connection.

Under any other server or protocol (uvicorn's own, a test client) there is no link, and the
relay keeps the plain ASGI path (a watcher task, `send`). tests/api/test_connection.py runs both.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast
from urllib.parse import unquote

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE
from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl

from mineru_gateway.errors import HeadersTooLarge

EXTENSION = "mineru_gateway.client"
HIGH_WATER = 64 * 1024  # unread request body bytes held before reading from the client pauses
# A request's head (request line and headers) past this is refused before it is all in. The
# app's own limit (api/limits.py, 32 KiB by default) answers heads below it; this one bounds
# what a client can make the protocol hold while a head never ends.
MAX_HEAD_BYTES = 1024 * 1024
LINGER_S = 2.0  # how long bytes are read and dropped after a refusal (`_refuse`)

# uvicorn's own checks of header names and values.
_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_INTERNAL_ERROR_HEADERS = [
    (b"content-type", b"text/plain; charset=utf-8"),
    (b"content-length", b"21"),
]

log = logging.getLogger("uvicorn.error")  # where uvicorn's protocol logged the same events

Message = MutableMapping[str, Any]
App = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]


class ClientLink:
    """One request on the client's connection: its ASGI `receive` and `send`, and the relay's
    way below them (`on_lost`, `respond`, `sink`)."""

    __slots__ = (
        "_body",
        "_body_bytes",
        "_on_lost",
        "_protocol",
        "_read_all",
        "_waiter",
        "chunked",
        "complete",
        "disconnected",
        "expect_continue",
        "head_only",
        "keep_alive",
        "left_to_send",
        "more_body",
        "started",
    )

    def __init__(self, protocol: GatewayHttpProtocol, keep_alive: bool, head_only: bool) -> None:
        self._protocol: GatewayHttpProtocol | None = protocol  # None once the answer is over
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._on_lost: Callable[[], None] | None = None
        self._read_all = False  # the body's last part went to the app
        self.keep_alive = keep_alive
        self.head_only = head_only  # a HEAD request: the answer has no body
        self.expect_continue = False
        self.more_body = True  # the request's body has not all arrived
        self.started = False  # the answer's head went out
        self.complete = False  # the whole answer went out
        self.chunked = False  # the answer's body goes in chunked framing
        self.left_to_send = 0  # of a sized answer's body
        self.disconnected = False  # the connection went before the answer was complete

    @staticmethod
    def of(scope: MutableMapping[str, Any]) -> ClientLink | None:
        """The link the gateway's protocol put in `scope`, or None under any other server."""
        extensions = scope.get("extensions")
        return extensions.get(EXTENSION) if extensions else None

    @property
    def done(self) -> bool:
        """The answer is complete or can no longer be given."""
        return self.complete or self.disconnected

    # -- the relay's side ---------------------------------------------------------------------
    def on_lost(self, callback: Callable[[], None] | None) -> None:
        """`callback` runs once if the connection is lost before the answer is complete (at
        once if it already is); None forgets it."""
        self._on_lost = callback
        if self.disconnected:
            self._report_lost()

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole answer, sized, in one write: what `send` does for a start and a last body
        message, without the two messages and the second write. Nothing is written to a
        connection that is gone."""
        protocol = self._protocol
        if protocol is None or self.disconnected:
            return
        if protocol.flow.write_paused:
            await protocol.flow.drain()
            if self.disconnected:
                return
        if self.started:
            raise RuntimeError("the answer has already started")
        content = _head_start(status, protocol.server_state.default_headers)
        for name, value in headers:
            if _BAD_VALUE.search(value):
                raise RuntimeError(f"invalid value of header {name!r}")
            content += (name, b": ", value, b"\r\n")
        content += (b"content-length: %d\r\n" % len(body),)
        if not self.keep_alive:
            content += (b"connection: close\r\n",)
        content += (b"\r\n",) if self.head_only else (b"\r\n", body)
        self.started = True
        self.expect_continue = False
        protocol.transport.write(b"".join(content))
        self._answered(protocol)

    # -- ASGI ---------------------------------------------------------------------------------
    async def receive(self) -> Message:
        protocol = self._protocol
        if protocol is not None and self.expect_continue:
            self.expect_continue = False
            if not protocol.transport.is_closing():
                protocol.transport.write(_CONTINUE)
        if protocol is not None and not self.disconnected:
            if self._read_all:
                await self._wait(protocol)  # what is left to hear of is the client leaving
            elif self.more_body and not self._body:
                protocol.flow.resume_reading()
                await self._wait(protocol)
        if self.disconnected or self.complete or self._read_all:
            return {"type": "http.disconnect"}
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._body_bytes = 0
        self._read_all = not self.more_body
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def _wait(self, protocol: GatewayHttpProtocol) -> None:
        """Until the body moves on, the answer is over or the connection is gone."""
        waiter = self._waiter = protocol.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    async def send(self, message: Message) -> None:
        protocol = self._protocol
        if protocol is None or self.disconnected:
            if self.complete:
                raise RuntimeError(f"unexpected ASGI message {message['type']!r} after the answer")
            return
        if protocol.flow.write_paused:
            await protocol.flow.drain()
            if self.disconnected:
                return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected 'http.response.start', got {kind!r}")
            self._start(protocol, message["status"], message.get("headers", ()))
            return
        if kind != "http.response.body":
            raise RuntimeError(f"expected 'http.response.body', got {kind!r}")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        transport = protocol.transport
        if self.head_only:
            pass
        elif self.chunked:
            if body:
                transport.write(
                    b"%x\r\n%b\r\n%s" % (len(body), body, b"" if more else b"0\r\n\r\n")
                )
            elif not more:
                transport.write(b"0\r\n\r\n")
        else:
            if len(body) > self.left_to_send:
                raise RuntimeError("the answer's body is longer than its content-length")
            self.left_to_send -= len(body)
            transport.write(body)
        if not more:
            if self.left_to_send and not self.head_only:
                raise RuntimeError("the answer's body is shorter than its content-length")
            self._answered(protocol)

    def _start(self, protocol: GatewayHttpProtocol, status: int, headers: Any) -> None:
        """Writes the head of an answer given through `send`; raises, with nothing written, on
        a header uvicorn would refuse."""
        content = _head_start(status, protocol.server_state.default_headers)
        length: int | None = None
        chunked = close = False
        for name, value in headers:
            if _BAD_NAME.search(name):
                raise RuntimeError(f"invalid header name {name!r}")
            if _BAD_VALUE.search(value):
                raise RuntimeError(f"invalid value of header {name!r}")
            name = name.lower()
            if name == b"content-length" and length is None and not chunked:
                length = int(value)
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                length, chunked = None, True
            elif name == b"connection" and b"close" in [
                token.strip().lower() for token in value.split(b",")
            ]:
                close = True
                continue
            content += (name, b": ", value, b"\r\n")
        if close:
            self.keep_alive = False
        if not self.keep_alive:
            content += (b"connection: close\r\n",)
        if length is None and not chunked and not self.head_only and status not in (204, 304):
            chunked = True
            content += (b"transfer-encoding: chunked\r\n",)
        content += (b"\r\n",)
        self.started, self.chunked, self.left_to_send = True, chunked, length or 0
        self.expect_continue = False
        protocol.transport.write(b"".join(content))

    # -- the protocol's side ------------------------------------------------------------------
    def _answered(self, protocol: GatewayHttpProtocol) -> None:
        self.complete = True
        self._protocol = None
        if self._waiter is not None:
            self._wake()
        protocol.answered(self)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _lost(self) -> None:
        """The connection is gone (called by the protocol)."""
        self._protocol = None
        if not self.complete:
            self.disconnected = True
            self._wake()
            self._report_lost()

    def _report_lost(self) -> None:
        callback, self._on_lost = self._on_lost, None
        if callback is not None and not self.complete:
            callback()


class ConnectionFlow:
    """Flow control both ways for one client connection: reading pauses while a request's body
    waits unread, writing waits while the transport's buffer is full."""

    __slots__ = ("_transport", "_writable", "read_paused", "write_paused")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._writable = asyncio.Event()
        self._writable.set()

    async def drain(self) -> None:
        await self._writable.wait()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            self._writable.clear()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            self._writable.set()


class GatewayHttpProtocol(asyncio.Protocol):
    """HTTP/1.1 over httptools for uvicorn's `Server` (module docstring)."""

    flow: ConnectionFlow  # from connection_made on

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.app: App = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.app_state = app_state
        if config.root_path or config.limit_concurrency is not None:
            # entry/server.py sets neither; the gateway's flow control does admission.
            raise ValueError("the gateway's protocol has no root_path or limit_concurrency")
        self.keep_alive_s: float = config.timeout_keep_alive
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int | None] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.answering: ClientLink | None = None  # the request being answered
        self.reading: ClientLink | None = None  # the request whose body is coming in
        self.waiting: deque[tuple[ClientLink, MutableMapping[str, Any]]] = deque()  # pipelined
        self.closing = False  # no request after the one being answered
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect_continue = False
        self._head_bytes: int | None = None  # read since a head began, None outside heads
        self._idle_since: float | None = None  # when the last answer ended, None while busy
        self._idle_timer: asyncio.TimerHandle | None = None

    # -- asyncio ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.server_state.connections.add(self)
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self.flow = ConnectionFlow(transport)
        self.server = get_local_addr(transport)
        self.client = get_remote_addr(transport)
        if is_ssl(transport):
            self.scheme = "https"
        self._idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        links: list[ClientLink | None] = [link for link, _ in self.waiting]
        links += (self.answering, self.reading)
        self.answering = self.reading = None
        self.waiting.clear()
        for link in links:
            if link is not None:
                link._lost()
        self.flow.resume_writing()
        self._stop_idle_timer()
        if exc is None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._idle_since = None
        try:
            self.parser.feed_data(data)
            if self._head_bytes is not None:  # a head not all in yet
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse_head()
        except httptools.HttpParserUpgrade:
            # An upgrade (WebSocket) was asked for: the request was served as a plain one, and
            # what follows it is not HTTP. The connection closes after the answer.
            self._close_after_answer()
        except httptools.HttpParserError:
            broken, self.reading = self.reading, None
            if broken is not None and broken is self.answering:
                self.transport.close()  # its body is malformed: it cannot be served
            elif self.answering is None:
                self._send_400()
            else:
                self._close_after_answer()  # a pipelined request is: the one before is not

    def eof_received(self) -> None:
        pass

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

    # -- uvicorn's Server ---------------------------------------------------------------------
    def shutdown(self) -> None:
        """The server stops: an idle connection closes now, a busy one after its answer."""
        if self.answering is None and self.reading is None:
            self.transport.close()
        else:
            self._close_after_answer()

    # -- httptools ----------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._expect_continue = False
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        # llhttp keeps trailing whitespace, which RFC 9110 section 5.5 excludes from the value.
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        if self.closing:
            return  # parsed in the same read as the request that ends the connection
        parser = self.parser
        method = parser.get_method().decode("ascii")
        version = parser.get_http_version()
        url = httptools.parse_url(self._url)
        path = url.path.decode("ascii")
        query: bytes | None = cast(Any, url).query  # None without one; its stub says bytes
        if "%" in path:
            path = unquote(path)
        link = ClientLink(
            self,
            keep_alive=version != "1.0" and parser.should_keep_alive() and not self.closing,
            head_only=method == "HEAD",
        )
        link.expect_continue = self._expect_continue
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "method": method,
            "root_path": "",
            "path": path,
            "raw_path": url.path,
            "query_string": query or b"",
            "headers": self._headers,
            "state": self.app_state.copy(),
            "extensions": {EXTENSION: link},
        }
        self.reading = link
        if self.answering is None:
            self._start(link, scope)
        else:
            self.flow.pause_reading()  # pipelined: answered in turn
            self.waiting.append((link, scope))

    def on_body(self, body: bytes) -> None:
        link = self.reading
        if link is not None and not (link.complete or link.disconnected):
            link._body.append(body)
            link._body_bytes += len(body)
            if link._body_bytes > HIGH_WATER:
                self.flow.pause_reading()
            if link._waiter is not None:
                link._wake()

    def on_message_complete(self) -> None:
        link = self.reading
        if link is not None:
            link.more_body = False
            if link._waiter is not None:
                link._wake()
            self.reading = None

    # -- answers ------------------------------------------------------------------------------
    def _start(self, link: ClientLink, scope: MutableMapping[str, Any]) -> None:
        self.answering = link
        task = self.loop.create_task(self._run(link, scope))
        tasks = self.server_state.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _run(self, link: ClientLink, scope: MutableMapping[str, Any]) -> None:
        try:
            await self.app(scope, link.receive, link.send)
        except BaseException as exc:
            log.error("Exception in ASGI application\n", exc_info=exc)
            if not link.started and not link.disconnected:
                self._internal_error(link)
            elif not link.done:
                self.transport.close()
        else:
            if not link.done:
                if link.started:
                    log.error("ASGI callable returned without completing response.")
                    self.transport.close()
                else:
                    log.error("ASGI callable returned without starting response.")
                    self._internal_error(link)

    def answered(self, link: ClientLink) -> None:
        """`link`'s answer is complete: the next pipelined request, or the connection idles."""
        self.server_state.total_requests += 1
        if self.answering is link:
            self.answering = None
        transport = self.transport
        if not link.keep_alive:
            transport.close()
            return
        if transport.is_closing():
            return
        self.flow.resume_reading()
        if self.waiting:
            self._start(*self.waiting.popleft())
        else:
            self._idle()

    def _internal_error(self, link: ClientLink) -> None:
        link.keep_alive = False
        link._start(self, 500, _INTERNAL_ERROR_HEADERS)
        self.transport.write(b"Internal Server Error")
        link._answered(self)

    def _close_after_answer(self) -> None:
        self.closing = True
        if self.reading is None:
            self.flow.pause_reading()  # nothing more to read (a body on its way still is)
        for link, _ in self.waiting:
            link._lost()
        self.waiting.clear()
        if self.answering is not None:
            self.answering.keep_alive = False
        else:
            self.transport.close()

    def _send_400(self) -> None:
        message = b"Invalid HTTP request received."
        log.warning(message.decode())
        self._refuse(400, b"text/plain; charset=utf-8", message)

    def _refuse_head(self) -> None:
        """A head past MAX_HEAD_BYTES: refused as the app refuses one past its own limit, and
        nothing more read from the connection."""
        self._head_bytes = None
        if self.answering is not None:
            self._close_after_answer()  # a pipelined one: the answer before it goes out first
            return
        error = HeadersTooLarge(
            f"the request's head is past {MAX_HEAD_BYTES} bytes before its end; this gateway "
            "accepts at most MINERU_GATEWAY_MAX_HEADER_BYTES of headers"
        )
        self._refuse(error.status, b"application/json", error.body_bytes())

    def _refuse(self, status: int, content_type: bytes, body: bytes) -> None:
        """An answer before any request could be made of the bytes, then the connection closed.

        For a client still sending: closing a socket with unread bytes makes
        the kernel reset the connection, and a reset can destroy the answer before the client
        reads it. So the answer is followed by the end of the stream, what still comes is read
        and dropped, and the connection closes when the client does or LINGER_S later (what
        nginx calls a lingering close)."""
        content = _head_start(status, self.server_state.default_headers)
        content += (
            b"content-type: %b\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%b"
            % (content_type, len(body), body),
        )
        transport = self.transport
        transport.write(b"".join(content))
        if transport.can_write_eof():
            transport.write_eof()
            self.parser = _DROP  # type: ignore[assignment]
            self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    # -- keep-alive ---------------------------------------------------------------------------
    def _idle(self) -> None:
        """No request in progress: the connection closes if it stays so for the keep-alive
        timeout. One timer per idle spell, not one armed and cancelled per answer: it checks,
        when it fires, whether the connection has been idle long enough."""
        self._idle_since = self.loop.time()
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_later(self.keep_alive_s, self._idle_check)

    def _idle_check(self) -> None:
        since = self._idle_since
        if since is None or self.answering is not None or self.reading is not None:
            left = self.keep_alive_s  # busy: look again a timeout later
        else:
            left = since + self.keep_alive_s - self.loop.time()
            if left <= 0:
                self._idle_timer = None
                self.transport.close()
                return
        self._idle_timer = self.loop.call_later(left, self._idle_check)

    def _stop_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None


class _Drop:
    """The parser of a connection whose bytes are no longer read: they are dropped."""

    def feed_data(self, data: bytes) -> None:
        pass


_DROP = _Drop()


def _head_start(status: int, default_headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """An answer's status line and the server's default headers (`date`, `server`), as the
    pieces of a head the caller goes on to add to and join."""
    content = [STATUS_LINE[status]]
    for name, value in default_headers:
        content += (name, b": ", value, b"\r\n")
    return content
