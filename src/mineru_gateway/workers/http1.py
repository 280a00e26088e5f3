"""A lean HTTP/1.1 client for the gateway's calls to workers: pooled keep-alive connections,
httptools (llhttp, the parser uvicorn uses) to read answers, nothing else per request.

Why not aiohttp's client: for a small non-streaming request, aiohttp's request path (its
`ClientRequest`, header defaults, cookie jar, tracing hooks, its own timeouts and writer) costs
more of the gateway's CPU than anything else it does (docs/proxy-costs.md), while a worker needs
only a request line, three headers and the body. This module does what the
relay needs and no more:

- one request per connection at a time, the body written at once (the relay holds it anyway);
- interim answers (1xx, RFC 9110 15.2) skipped: the answer is the final one after them;
- an answer's head bounded in bytes while it arrives, and its status one a client may be given
  (200-599; a switch of protocols, 101, is not one);
- an answer's headers, then its body as it arrives (`Answer.read_some`), with reading from the
  worker paused while a slow reader holds more than HIGH_WATER bytes;
- a connection goes back to the pool the moment its answer has ended, and is closed instead if
  the answer did not end: that is how a worker learns nobody waits for its generation (vLLM
  aborts it and frees its KV cache).

Errors are this module's own (`ConnectFailed`, `Disconnected`, `Malformed`, `BadStatus`);
`workers.upstream` maps them to gateway errors, the one place that does.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools
import structlog

log = structlog.get_logger("mineru_gateway.upstream")


class ConnectFailed(Exception):
    """No connection was made: nothing of the request reached the worker."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class Disconnected(Exception):
    """The worker closed the connection before its answer ended."""


class Malformed(Exception):
    """The worker's bytes are not HTTP/1.1."""


class BadStatus(Malformed):
    """The worker's final answer has a status no client may be given: a switch of protocols
    (101), or one outside 200-599."""

    def __init__(self, status: int) -> None:
        super().__init__(f"the worker answered with status {status}")
        self.status = status


MAX_HEAD_BYTES = 64 * 1024  # an answer's head: its header names and values, all together
HIGH_WATER = 256 * 1024  # body bytes held for a reader before reading from the worker pauses
ONE_WRITE = 64 * 1024  # a request body below this goes out in one write with its head


class Answer:
    """A worker's answer once its headers are in: status, content type, and the body to come.

    Body bytes are kept until read (`read_some` joins whatever arrived since the last read, so
    events that came in several reads leave in one write). `close()` drops the connection if
    the answer has not ended; an ended answer's connection is already back in the pool.
    """

    __slots__ = (
        "_buffered",
        "_buffered_bytes",
        "_connection",
        "_error",
        "_paused",
        "_waiter",
        "content_type",
        "ended",
        "status",
    )

    def __init__(self, connection: _Connection) -> None:
        self._connection: _Connection | None = connection
        self.status = 0
        self.content_type = ""
        self.ended = False
        self._buffered: deque[bytes] = deque()
        self._buffered_bytes = 0
        self._paused = False  # reading from the worker, held until the reader catches up
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- the reader's side ------------------------------------------------------------------
    async def read_some(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some; b"" at its end."""
        while not self._buffered:
            if self._error is not None:
                raise self._error
            if self.ended:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if len(self._buffered) == 1:
            data = self._buffered.popleft()
        else:
            data = b"".join(self._buffered)
            self._buffered.clear()
        self._buffered_bytes = 0
        if self._paused:
            self._paused = False
            if self._connection is not None:
                self._connection.resume_reading()
        return data

    def whole(self) -> bytes | None:
        """The whole body if all of it has already arrived (no waiting), else None."""
        if not self.ended or self._error is not None:
            return None
        data = b"".join(self._buffered)
        self._buffered.clear()
        self._buffered_bytes = 0
        return data

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while data := await self.read_some():
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Drops the connection unless the answer ended (then it is in the pool already)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.abort()

    # -- the connection's side ----------------------------------------------------------------
    def _body(self, data: bytes) -> None:
        """Body bytes from the worker, kept for `read_some`."""
        self._buffered.append(data)
        self._buffered_bytes += len(data)
        if self._buffered_bytes > HIGH_WATER and not self._paused and self._connection is not None:
            # A reader slower than the worker (a slow client): the worker is held back by
            # TCP, not the gateway's memory (the slow-reader fault test).
            self._paused = True
            self._connection.pause_reading()
        self._wake()

    def _end(self) -> None:
        self.ended = True
        if self._paused and self._connection is not None:
            self._connection.resume_reading()  # it goes back to the pool
        self._connection = None
        self._wake()

    def _fail(self, error: Exception) -> None:
        if self.ended or self._error is not None:
            return
        self._error = error
        self._connection = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


Slot = tuple[bool, str, int]  # TLS, host, port: the connections a request may reuse


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one worker; the httptools parser calls its `on_*`."""

    def __init__(self, pool: Http1Pool, slot: Slot) -> None:
        # Made by the loop's create_connection; kept, since each lookup of the running loop is
        # a getpid() system call on Python 3.11, and a request would make one more.
        self._loop = asyncio.get_running_loop()
        self._pool = pool
        self.slot = slot
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._feed: Callable[[bytes], None] = self._parser.feed_data  # bound once: per event
        self._answer: Answer | None = None
        self._head: asyncio.Future[Answer] | None = None
        self._content_type = b""
        self._sized = False  # the answer has a Content-Length or chunked framing
        self._head_bytes = 0  # the header names and values of the head under way
        self._head_read = 0  # the bytes read while the head under way is incomplete
        self._interim = False  # the message being parsed is a 1xx, not the answer
        self.idle_since = 0.0

    # -- the pool's side ----------------------------------------------------------------------
    def send(self, head: bytes, body: bytes) -> asyncio.Future[Answer]:
        """Writes one whole request; the future has the answer once its headers are in."""
        assert self.transport is not None and self._head is None and self._answer is None
        self._head = self._loop.create_future()
        self._content_type, self._sized, self._head_bytes = b"", False, 0
        self._head_read, self._interim = 0, False
        self._answer = Answer(self)
        if len(body) < ONE_WRITE:
            self.transport.write(head + body)
        else:  # page images: not copied once more to save a system call
            self.transport.write(head)
            self.transport.write(body)
        return self._head

    def pause_reading(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def abort(self) -> None:
        self._pool.forget(self)
        if self.transport is not None:
            self.transport.abort()

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    # -- asyncio --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        answer = self._answer
        if answer is None:  # bytes nobody asked for: the connection is not to be trusted
            self.abort()
            return
        heading = self._head is not None
        if heading:
            self._head_read += len(data)
        try:
            self._feed(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as error:
            # A callback's own error (BadStatus, an over-long head) comes as the context of
            # httptools' HttpParserCallbackError.
            cause = error.__context__
            if not isinstance(cause, Malformed):
                cause = Malformed(f"malformed answer: {error}")
            self._failed(cause)
            self.abort()
            return
        if heading and self._head is not None and self._head_read > MAX_HEAD_BYTES:
            # A head still incomplete: llhttp reports a header only at the end of its value,
            # and httptools joins the value's pieces anew at every read (quadratic), so a value
            # that never ends is bounded here, as its bytes arrive, not in on_header.
            self._failed(Malformed(f"an answer's head longer than {MAX_HEAD_BYTES} bytes"))
            self.abort()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool.forget(self)
        self.transport = None
        answer = self._answer
        if exc is None and answer is not None and self._head is None and not self._sized:
            self._answer = None  # a body that runs to the end of the connection has ended
            answer._end()
            return
        reason = f": {exc}" if exc else ""
        self._failed(Disconnected(f"the worker closed the connection{reason}"))

    # -- httptools ------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:  # llhttp has no limit of its own
            raise Malformed(f"an answer's head longer than {MAX_HEAD_BYTES} bytes")
        lowered = name.lower()
        if lowered == b"content-type":
            self._content_type = value
        elif lowered in (b"content-length", b"transfer-encoding"):
            self._sized = True

    def on_headers_complete(self) -> None:
        head, answer = self._head, self._answer
        if head is None or answer is None:  # a second answer to one request
            raise Malformed("an answer nobody asked for")
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # An interim answer (100 Continue, 103 Early Hints: RFC 9110 15.2); the final one
            # follows on the same connection. Its head is counted on its own.
            self._interim = True
            self._content_type, self._sized, self._head_bytes = b"", False, 0
            self._head_read = 0
            return
        if not 200 <= status < 600:  # 101 would hand the connection to another protocol
            raise BadStatus(status)
        answer.status = status
        answer.content_type = self._content_type.decode("latin-1") or "application/json"
        self._head = None
        if not head.done():
            head.set_result(answer)

    def on_body(self, body: bytes) -> None:
        answer = self._answer
        if answer is not None:
            answer._body(body)

    def on_message_complete(self) -> None:
        if self._interim:  # the end of a 1xx (it has no body): the answer is still to come
            self._interim = False
            return
        answer, self._answer = self._answer, None
        if answer is None:
            return
        answer._end()
        transport = self.transport
        if (
            transport is not None
            and self._parser.should_keep_alive()
            and transport.get_write_buffer_size() == 0  # the worker read the whole request
        ):
            self._pool.put_back(self)
        else:
            self.abort()

    def _failed(self, error: Exception) -> None:
        head, self._head = self._head, None
        answer, self._answer = self._answer, None
        if head is not None and not head.done():
            head.set_exception(error)
        if answer is not None:
            answer._fail(error)


class _Key:
    """Where a URL's request goes: one pool of connections per scheme, host and port."""

    __slots__ = ("host", "netloc", "path", "port", "slot", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.netloc = parts.netloc
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.slot: Slot = (self.tls, self.host, self.port)


class Http1Pool:
    """Keep-alive connections to the workers, newest first; one request per connection."""

    # Parsed URLs kept: at least MIN_KEYS, and KEYS_PER_SLOT per worker (scheme, host, port)
    # known, so that the table grows with the fleet (a worker has a handful: its API's paths, its
    # probes, its reads). Past that, the oldest goes, with a warning (docs/operate/fleet-scale.md).
    MIN_KEYS = 4096
    KEYS_PER_SLOT = 16

    def __init__(self, connect_timeout_s: float, keepalive_s: float) -> None:
        # Made on the loop it serves (its connections are that loop's), and kept: on Python
        # 3.11 each lookup of the running loop is a getpid() system call.
        self._loop = asyncio.get_running_loop()
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._idle: dict[Slot, list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._keys: dict[str, _Key] = {}
        self._per_slot: dict[Slot, int] = {}  # parsed URLs kept per worker
        self.evicted = 0  # parsed URLs let go for room: more paths per worker than expected
        self._tls: ssl.SSLContext | None = None
        self._sweep: asyncio.TimerHandle | None = None

    async def request(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes, deadline_s: float
    ) -> Answer:
        """Sends a request and returns the answer once its headers are in. Raises
        ConnectFailed (nothing was sent), Disconnected, Malformed, or TimeoutError when the
        headers did not come within `deadline_s` (a connection made in that time included)."""
        key = self._key(url)
        head = _request_head(method, key, headers, body)
        with Deadline(deadline_s, self._loop):
            connection = self._take_idle(key) or await self._connect(key)
            self._busy.add(connection)
            try:
                return await connection.send(head, body)
            except BaseException:
                connection.abort()  # an answer nobody will read: the worker is to stop it
                raise

    def forget(self, connection: _Connection) -> None:
        self._busy.discard(connection)
        idle = self._idle.get(connection.slot)
        if idle and connection in idle:
            idle.remove(connection)

    def put_back(self, connection: _Connection) -> None:
        self._busy.discard(connection)
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.slot, []).append(connection)
        if self._sweep is None:
            self._sweep = self._loop.call_later(self._keepalive_s, self._close_stale)

    def close(self) -> None:
        for connection in [*self._busy, *(c for idle in self._idle.values() for c in idle)]:
            connection.abort()
        self._busy.clear()
        self._idle.clear()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    @property
    def connections(self) -> int:
        """Open connections, idle or busy."""
        return len(self._busy) + sum(len(idle) for idle in self._idle.values())

    def _key(self, url: str) -> _Key:
        key = self._keys.get(url)
        if key is None:
            key = self._keys[url] = _Key(url)
            self._per_slot[key.slot] = self._per_slot.get(key.slot, 0) + 1
            if len(self._keys) > max(self.MIN_KEYS, self.KEYS_PER_SLOT * len(self._per_slot)):
                self._evict_oldest()
        return key

    def _evict_oldest(self) -> None:
        oldest = self._keys.pop(next(iter(self._keys)))
        left = self._per_slot[oldest.slot] - 1
        if left:
            self._per_slot[oldest.slot] = left
        else:
            del self._per_slot[oldest.slot]
        self.evicted += 1
        if self.evicted & (self.evicted - 1) == 0:  # the 1st, 2nd, 4th, 8th...: loud, not a flood
            log.warning("upstream_url_table_full", kept=len(self._keys), evicted=self.evicted)

    def _take_idle(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key.slot)
        oldest = time.monotonic() - self._keepalive_s
        while idle:
            connection = idle.pop()
            if connection.usable and connection.idle_since > oldest:
                return connection
            connection.abort()
        return None

    async def _connect(self, key: _Key) -> _Connection:
        loop = asyncio.get_running_loop()
        where = f"{key.host}:{key.port}"
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, key.slot), key.host, key.port, ssl=self._tls_for(key)
                )
        except TimeoutError:
            limit = self._connect_timeout_s
            raise ConnectFailed(
                f"no connection to {where} within {limit} s", timed_out=True
            ) from None
        except (OSError, ssl.SSLError) as error:
            raise ConnectFailed(f"cannot connect to {where}: {error}", timed_out=False) from None
        return connection

    def _tls_for(self, key: _Key) -> ssl.SSLContext | None:
        if not key.tls:
            return None
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _close_stale(self) -> None:
        self._sweep = None
        oldest = time.monotonic() - self._keepalive_s
        for idle in self._idle.values():
            for connection in [c for c in idle if c.idle_since <= oldest]:
                idle.remove(connection)
                connection.abort()
        if any(self._idle.values()):
            self._sweep = asyncio.get_running_loop().call_later(
                self._keepalive_s, self._close_stale
            )


class Deadline:
    """`with Deadline(seconds):` cancels the current task at the deadline and turns that
    cancellation, told from any other, into TimeoutError. One timer: cheaper than
    asyncio.timeout on paths taken per request."""

    __slots__ = ("_fired", "_handle", "_task")

    def __init__(self, seconds: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """`loop`: the running loop, if the caller has it (on Python 3.11 each lookup of the
        running loop is a getpid() call)."""
        loop = loop or asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self._task = task
        self._fired = False
        self._handle = loop.call_later(max(0.0, seconds), self._fire)

    def _fire(self) -> None:
        self._fired = True
        self._task.cancel()

    def __enter__(self) -> Deadline:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: object, trace: object) -> None:
        self._handle.cancel()
        # The cancellation was this deadline's (and is withdrawn): the time ran out.
        if kind is asyncio.CancelledError and self._fired and self._task.uncancel() == 0:
            raise TimeoutError from None


def _request_head(method: str, key: _Key, headers: Mapping[str, str], body: bytes) -> bytes:
    lines = [f"{method} {key.path} HTTP/1.1\r\nHost: {key.netloc}\r\n"]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}\r\n")
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name} has a line break")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")
