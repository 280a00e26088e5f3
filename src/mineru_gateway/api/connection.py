"""The gateway's HTTP/1.1 server protocol, and the client's connection as the relay sees it.

`GatewayHttpProtocol` serves HTTP/1.1 over httptools (llhttp) and hands every request a
`ClientLink`: the request's ASGI `receive` and `send` and, in its scope's extensions, what the
relay uses below them: a callback for the connection's loss (called from `connection_lost`, no
task parked in `receive`) and a whole answer's head and body in one write (`respond`). One
object is the request's cycle and its link. The connections of one server share an `Edge` (the
app, its lifespan state, the timeouts, the default headers); entry/server.py runs them.

What it does (docs/http-edge.md lists it with the tests that hold it):

- keep-alive (HTTP/1.1 unless `Connection: close`; HTTP/1.0 closes);
- three clocks per connection, as nginx's client_header_timeout, client_body_timeout and
  keepalive_timeout (`Timeouts`): a head must be all in within the head timeout (408, or the
  connection closed behind an answer), a body the app waits for must not stop for the body idle
  timeout (408 if no answer started, and the app told the client is gone), an idle connection
  closes after the keep-alive timeout; one timer per connection checks them when it fires;
- pipelined requests answered in order, one at a time, reading paused while one waits;
- flow control both ways (`ConnectionFlow`): reading pauses while a request's unread body is
  past 64 KiB, writing waits while the transport's buffer is full;
- `Expect: 100-continue` answered when the app first reads the body;
- a malformed request or body framing (RFC 9112: an unknown transfer coding, a broken chunk,
  Content-Length with Transfer-Encoding or twice) answered 400 if no answer has started, and
  the connection closed; the app of a request whose body broke is told the client is gone;
- an upgrade request (WebSocket, h2c) served as a plain HTTP/1.1 request, body included, and
  the connection kept for the requests after it;
- a head that goes on past MAX_HEAD_BYTES refused (431) before it ends; the 400, 408 and 431
  are in OpenAI's form and end with a lingering close (`_refuse`), so a client still sending
  reads them;
- the server's default headers (`date`, `server`), and the graceful shutdown: idle
  connections close at once, busy ones after their answer;
- an app that fails before answering gets a plain 500, one that fails mid-answer a closed
  connection.

Under any other server or protocol (uvicorn's own, a test client) there is no link, and the
relay keeps the plain ASGI path (a watcher task, `send`). tests/api/test_connection.py runs both.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import httptools
import structlog

from mineru_gateway.errors import GatewayError, HeadersTooLarge, InvalidRequest, RequestTimeout

EXTENSION = "mineru_gateway.client"
HIGH_WATER = 64 * 1024  # unread request body bytes held before reading from the client pauses
# A request's head (request line and headers) past this is refused before it is all in. The
# app's own limit (api/limits.py, 32 KiB by default) answers heads below it; this one bounds
# what a client can make the protocol hold while a head never ends.
MAX_HEAD_BYTES = 1024 * 1024
LINGER_S = 2.0  # how long bytes are read and dropped after a refusal (`_refuse`)

# The checks uvicorn's protocol makes of an answer's header names and values.
_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_INTERNAL_ERROR_HEADERS = [
    (b"content-type", b"text/plain; charset=utf-8"),
    (b"content-length", b"21"),
]

SERVER_LINE = b"server: mineru-gateway\r\n"  # on every answer, after its date
_PHRASES = {status.value: status.phrase.encode() for status in HTTPStatus}
# Every status line, as uvicorn's protocol writes them: an unknown status has an empty reason.
_STATUS_LINES = {
    status: b"HTTP/1.1 %d %b\r\n" % (status, _PHRASES.get(status, b""))
    for status in range(100, 600)
}

log = structlog.get_logger("mineru_gateway.edge")

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
        "loop",
        "more_body",
        "started",
    )

    def __init__(self, protocol: GatewayHttpProtocol, keep_alive: bool, head_only: bool) -> None:
        self._protocol: GatewayHttpProtocol | None = protocol  # None once the answer is over
        self.loop = protocol.loop  # the connection's: no lookup of the running loop per request
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
        content = _head_start(status, protocol.edge.default_head)
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
                protocol.read_at = protocol.loop.time()  # the body's clock starts now
        if protocol is not None and not self.disconnected:
            if self._read_all:
                await self._wait(protocol)  # what is left to hear of is the client leaving
            elif self.more_body and not self._body:
                protocol.resume_reading()
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
        content = _head_start(status, protocol.edge.default_head)
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


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long the edge waits on a client, in seconds (docs/http-edge.md)."""

    head_s: float = 10.0  # from a head's first byte to its end
    body_idle_s: float = 30.0  # between two reads of a body the app waits for
    keep_alive_s: float = 30.0  # an idle connection, between answers or before the first

    @property
    def step_s(self) -> float:
        """The longest a connection's timer waits before it looks again: no clock can start
        and run out between two looks."""
        return min(self.head_s, self.body_idle_s, self.keep_alive_s)


class Edge:
    """What one server's connections share: the app and its lifespan state, the timeouts, the
    headers every answer carries, and what the server drains when it stops (the connections,
    the requests' tasks)."""

    __slots__ = (
        "app",
        "app_state",
        "connections",
        "default_head",
        "tasks",
        "timeouts",
        "total_requests",
    )

    def __init__(self, app: App, timeouts: Timeouts | None = None) -> None:
        self.app = app
        self.app_state: dict[str, Any] = {}  # the lifespan's state, copied into each scope
        self.timeouts = timeouts or Timeouts()
        self.connections: set[GatewayHttpProtocol] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.total_requests = 0
        self.default_head = b""
        self.set_date(None)

    def set_date(self, now: float | None) -> None:
        """The `date` header from `now` (seconds since the epoch; None: the current time). The
        server calls it once a second: formatting it, or joining the default headers' lines,
        per answer would cost each request."""
        date = formatdate(now, usegmt=True).encode()
        self.default_head = b"date: %b\r\n%b" % (date, SERVER_LINE)


class GatewayHttpProtocol(asyncio.Protocol):
    """HTTP/1.1 over httptools for the gateway's server (module docstring)."""

    flow: ConnectionFlow  # from connection_made on

    def __init__(self, edge: Edge, _loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.edge = edge
        self.app: App = edge.app
        self.timeouts = edge.timeouts
        self.loop = _loop or asyncio.get_event_loop()
        self.parser = _parser(self)
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
        # An upgrade request with a body, held while llhttp stops short of its body
        # (`_after_upgrade`): its link and the body's framing header.
        self._upgrading: tuple[ClientLink, bytes] | None = None
        # The clocks `_check` reads (loop time): the last read, the start of the head being
        # read (None outside heads), the end of the last answer.
        self.read_at = self._idle_since = self.loop.time()
        self._head_began: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.edge.connections.add(self)
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self.flow = ConnectionFlow(transport)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        if transport.get_extra_info("sslcontext") is not None:
            self.scheme = "https"
        self._timer = self.loop.call_later(self.timeouts.step_s, self._check)

    def connection_lost(self, exc: Exception | None) -> None:
        self.edge.connections.discard(self)
        self._drop_requests()
        self.flow.resume_writing()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if exc is None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self.read_at = self.loop.time()
        try:
            self.parser.feed_data(data)
            if self._head_bytes is not None:  # a head not all in yet
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse_head()
        except httptools.HttpParserUpgrade as upgrade:
            self._after_upgrade(data[upgrade.args[0] :])
        except httptools.HttpParserError as error:
            self._malformed(error)

    def eof_received(self) -> None:
        pass

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

    # -- the server ---------------------------------------------------------------------------
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
        self._head_began = self.read_at

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        # llhttp keeps trailing whitespace, which RFC 9110 section 5.5 excludes from the value.
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        elif name == b"transfer-encoding" and value.lower() != b"chunked":
            # llhttp refuses most codings, but takes a list that ends in chunked ("gzip,
            # chunked") and hands on a body still gzipped. The gateway decodes no coding but
            # chunked (RFC 9112 section 6.1: 400 or 501 and close).
            raise _Malformed(f"unsupported Transfer-Encoding {value.decode('latin-1')!r}")
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_bytes = self._head_began = None
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
            "state": self.edge.app_state.copy(),
            "extensions": {EXTENSION: link},
        }
        self.reading = link
        if self.answering is None:
            self._start(link, scope)
        else:
            self.flow.pause_reading()  # pipelined: answered in turn
            self.waiting.append((link, scope))
        if parser.should_upgrade():
            self._hold_for_upgrade(link)

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

    # -- what llhttp stops at -----------------------------------------------------------------
    def _malformed(self, error: httptools.HttpParserError) -> None:
        """The bytes are no HTTP/1.1, or a body's framing broke (RFC 9112): nothing after it
        can be read. 400 if no answer has started, else the connection closes (after the
        answer before, for a pipelined request)."""
        context = error.__context__  # what a callback raised: its reason is the better one
        cause = context if isinstance(context, (_Malformed, httptools.HttpParserError)) else error
        broken, self.reading = self.reading, None
        client = self.client
        log.info("malformed_request", client=client[0] if client else None, reason=str(cause))
        if self.answering is None or broken is self.answering:
            self._abandon(InvalidRequest(f"malformed request: {cause}", code="malformed_request"))
        else:
            self._close_after_answer()  # a pipelined request is: the one before is not

    def _hold_for_upgrade(self, link: ClientLink) -> None:
        """An upgrade request (WebSocket, h2c) is served as plain HTTP/1.1, but httptools has
        llhttp skip its body and stop: the link stays unfinished until `_after_upgrade` reads
        the body by its framing."""
        framing = b""
        for name, value in self._headers:
            if name == b"content-length" and value != b"0":
                framing = b"content-length: %b\r\n" % value
            elif name == b"transfer-encoding":
                framing = b"transfer-encoding: chunked\r\n"
        if framing:
            self._upgrading = (link, framing)
            self.reading = None  # the llhttp's end of the message is not the body's

    def _after_upgrade(self, rest: bytes) -> None:
        """llhttp stopped after an upgrade request's head: a new parser takes over. Given the
        request's body framing in a head of its own that no request is made of, it reads the
        body into the held link, then the requests after it. The connection stays usable: a
        client that asked to upgrade and got a plain answer goes on in HTTP/1.1 (RFC 9110
        section 7.8)."""
        upgrading, self._upgrading = self._upgrading, None
        if upgrading is None:
            self.parser = _parser(self)
        else:
            self.parser = _parser(_BodyThenRequests(self))
            self.reading, framing = upgrading
            self.parser.feed_data(b"PUT / HTTP/1.1\r\n%b\r\n" % framing)
        if rest:
            self.data_received(rest)

    # -- answers ------------------------------------------------------------------------------
    def _start(self, link: ClientLink, scope: MutableMapping[str, Any]) -> None:
        self.answering = link
        task = self.loop.create_task(self._run(link, scope))
        tasks = self.edge.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _run(self, link: ClientLink, scope: MutableMapping[str, Any]) -> None:
        try:
            await self.app(scope, link.receive, link.send)
        except BaseException as exc:
            log.error("app_failed", path=scope["path"], exc_info=exc)
            if not link.started and not link.disconnected:
                self._internal_error(link)
            elif not link.done:
                self.transport.close()
        else:
            if not link.done:
                if link.started:
                    log.error("app_returned_mid_answer", path=scope["path"])
                    self.transport.close()
                else:
                    log.error("app_returned_without_answer", path=scope["path"])
                    self._internal_error(link)

    def answered(self, link: ClientLink) -> None:
        """`link`'s answer is complete: the next pipelined request, or the connection idles."""
        self.edge.total_requests += 1
        if self.answering is link:
            self.answering = None
        transport = self.transport
        if not link.keep_alive:
            transport.close()
            return
        if transport.is_closing():
            return
        self.resume_reading()
        if self.waiting:
            self._start(*self.waiting.popleft())
        else:
            self._idle_since = self.loop.time()

    def resume_reading(self) -> None:
        """Reading goes on; the client's clocks restart, as nothing could come while paused."""
        if self.flow.read_paused:
            self.read_at = now = self.loop.time()
            if self._head_began is not None:
                self._head_began = now
            self.flow.resume_reading()

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

    def _drop_requests(self) -> None:
        """Every request on the connection is over: each app still at one hears the client
        has gone."""
        links: list[ClientLink | None] = [link for link, _ in self.waiting]
        links += (self.answering, self.reading)
        self.answering = self.reading = None
        self.waiting.clear()
        for link in links:
            if link is not None:
                link._lost()

    def _abandon(self, error: GatewayError) -> None:
        """No more of the connection can be read (a broken or stalled request): the request
        being answered ends (its app hears the client has gone), the client gets `error` if
        no answer has started, and the connection closes."""
        answering = self.answering
        self._drop_requests()
        if answering is not None and answering.started:
            self.transport.close()
        else:
            self._refuse(error)

    def _refuse_head(self) -> None:
        """A head past MAX_HEAD_BYTES: refused as the app refuses one past its own limit, and
        nothing more read from the connection."""
        self._head_bytes = None
        if self.answering is not None:
            self._close_after_answer()  # a pipelined one: the answer before it goes out first
            return
        self._refuse(
            HeadersTooLarge(
                f"the request's head is past {MAX_HEAD_BYTES} bytes before its end; this "
                "gateway accepts at most MINERU_GATEWAY_MAX_HEADER_BYTES of headers"
            )
        )

    def _refuse(self, error: GatewayError) -> None:
        """`error` in OpenAI's form as the connection's last answer, then the connection closed.

        For a client still sending: closing a socket with unread bytes makes
        the kernel reset the connection, and a reset can destroy the answer before the client
        reads it. So the answer is followed by the end of the stream, what still comes is read
        and dropped, and the connection closes when the client does or LINGER_S later (what
        nginx calls a lingering close)."""
        body = error.body_bytes()
        content = _head_start(error.status, self.edge.default_head)
        content += (
            b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%b"
            % (len(body), body),
        )
        self.closing = True
        self._head_bytes = self._head_began = None
        if self._timer is not None:
            self._timer.cancel()  # the lingering close ends the connection
            self._timer = None
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(b"".join(content))
        self.parser = _DROP  # type: ignore[assignment]
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    # -- the clocks ---------------------------------------------------------------------------
    def _check(self) -> None:
        """The connection's one timer: it looks at which clock runs (a head coming in, a body
        the app waits for, an idle connection), acts on one that ran out, and looks again at
        that clock's end or a step later. Arming a timer per read or per request would cost
        every request; this one costs a callback per step."""
        self._timer = None
        if self.transport.is_closing():
            return
        due = self._run_clocks(self.loop.time())
        if due is not None:
            self._timer = self.loop.call_at(due, self._check)

    def _run_clocks(self, now: float) -> float | None:
        """When to look again, or None once a clock ran out and the connection ends."""
        timeouts = self.timeouts
        due = now + timeouts.step_s
        if self.flow.read_paused:
            return due  # nothing can come: resume_reading restarts the clocks
        if self._head_began is not None:
            end = self._head_began + timeouts.head_s
            if end > now:
                return min(due, end)
            if self.answering is None:
                self._refuse(RequestTimeout(_late("head", timeouts.head_s, "HEAD_TIMEOUT_S")))
                return None
            self._head_began = self._head_bytes = None
            self._close_after_answer()  # a pipelined head: the answer before it goes out first
        elif self._awaits_body():
            end = self.read_at + timeouts.body_idle_s
            if end > now:
                return min(due, end)
            seconds = timeouts.body_idle_s
            self._abandon(RequestTimeout(_late("body", seconds, "BODY_IDLE_TIMEOUT_S")))
            return None
        elif self.answering is None and self.reading is None:
            end = self._idle_since + timeouts.keep_alive_s
            if end > now:
                return min(due, end)
            self.transport.close()
            return None
        return due

    def _awaits_body(self) -> bool:
        link = self.reading
        return link is not None and link is self.answering and link._waiter is not None


class _Malformed(Exception):
    """Raised from a parser callback: the request is malformed in a way llhttp lets by."""


class _BodyThenRequests:
    """The callbacks of the parser that takes over after an upgrade request (`_after_upgrade`):
    the first message's head is the body's framing alone, not a request; its body and end go
    to the held request, and every message after it is a request as usual."""

    __slots__ = ("_framing", "_protocol")

    def __init__(self, protocol: GatewayHttpProtocol) -> None:
        self._protocol = protocol
        self._framing = True

    def on_message_begin(self) -> None:
        if not self._framing:
            self._protocol.on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._framing:
            self._protocol.on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._framing:
            self._protocol.on_header(name, value)

    def on_headers_complete(self) -> None:
        if not self._framing:
            self._protocol.on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._protocol.on_body(body)

    def on_message_complete(self) -> None:
        self._framing = False
        self._protocol.on_message_complete()


class _Drop:
    """The parser of a connection whose bytes are no longer read: they are dropped."""

    def feed_data(self, data: bytes) -> None:
        pass


_DROP = _Drop()


def _late(part: str, seconds: float, setting: str) -> str:
    if part == "head":
        return f"the request's head did not arrive within {seconds:g} s (MINERU_GATEWAY_{setting})"
    return f"no byte of the request's body came for {seconds:g} s (MINERU_GATEWAY_{setting})"


def _parser(callbacks: Any) -> httptools.HttpRequestParser:
    parser = httptools.HttpRequestParser(callbacks)
    parser.set_dangerous_leniencies(lenient_data_after_close=True)
    return parser


def _address(info: Any) -> tuple[str, int] | None:
    """A socket address as ASGI's scope gives it: host and port (None for a Unix socket)."""
    if isinstance(info, tuple) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    return None


def _head_start(status: int, default_head: bytes) -> list[bytes]:
    """An answer's status line and the server's default headers' lines (`Edge.default_head`),
    as the pieces of a head the caller goes on to add to and join."""
    return [_STATUS_LINES[status], default_head]
