"""The one seam for calls to workers, and the one place transport errors become GatewayErrors.

aiohttp, not httpx, carries the hot path: a plain httpx streaming relay delivered under half of the
offered SSE events at 128 streams on these machines, aiohttp about 7x less CPU per event
(docs/proxy-costs.md; our own figures in benchmarks/results/).
"""

from __future__ import annotations

import asyncio
import io
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp.http_exceptions import HttpProcessingError

from mineru_gateway.errors import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamTimeout,
)


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float
    first_byte_s: float
    idle_s: float


class _Watchdog:
    """A deadline on the worker's silence, at the cost of one clock read per chunk.

    Only the time spent waiting on the worker counts (from `waiting()` to the next
    `arrived()`): while the relay is held up by a slow client, backpressure keeps the worker
    from sending, and that is not its silence (issue 14's slow-reader fault test: a stream read
    slower than the idle limit was cut, and the cut taken for a client disconnect). The timer
    fires only while waiting, so its cancellation always lands in the worker read that
    `iter_chunks` turns into UpstreamTimeout.

    `asyncio.timeout(...).reschedule()` per chunk costs a timer handle each time (~3 us, a few
    percent of the relay's whole cost per event); this timer is re-armed only when it fires.
    """

    def __init__(self, first_s: float, idle_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._idle = idle_s
        self._last = self._loop.time()
        self._limit = first_s
        self._waiting = True
        self._fired = False
        self._handle = self._loop.call_at(self._last + first_s, self._check)

    def waiting(self) -> None:
        """The relay asks the worker for the next chunk."""
        self._last = self._loop.time()
        self._waiting = True

    def arrived(self) -> None:
        """A chunk came: the relay holds it until the client has taken it."""
        self._waiting = False
        if self._limit != self._idle:  # the first chunk: from now on, the idle limit
            self._limit = self._idle
            self._handle.cancel()
            self._handle = self._loop.call_at(self._loop.time() + self._idle, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        deadline = self._last + self._limit
        if self._waiting and now >= deadline:
            self._fired = True
            self._task.cancel()
        else:  # held by the client, the deadline is a whole limit after it asks again
            self._handle = self._loop.call_at(
                deadline if self._waiting else now + self._limit, self._check
            )

    def progress(self) -> None:
        """Bytes came and went straight on (a splice): the worker is not silent."""
        self._last = self._loop.time()

    def expire_cancel(self) -> bool:
        """True (and the cancellation withdrawn) if the cancellation was this deadline's."""
        return self._fired and self._task.uncancel() == 0

    def stop(self) -> None:
        self._handle.cancel()


class UpstreamResponse:
    """A worker's answer whose headers have arrived; the body is read or streamed on demand.

    `close()` drops the connection instead of returning it to the pool: that is how a worker
    learns that nobody waits for the answer any more, and vLLM then aborts the generation.
    """

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        timeouts: Timeouts,
        watched: weakref.WeakSet[asyncio.Future[None]],
    ) -> None:
        self._response = response
        self._timeouts = timeouts
        self.status = response.status
        self.content_type = response.headers.get("Content-Type", "application/json")
        self._guard = _BodyGuard(response, watched)

    @property
    def is_event_stream(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    async def read(self) -> bytes:
        try:
            async with asyncio.timeout(self._timeouts.first_byte_s):
                return await self._response.read()
        except TimeoutError:
            raise UpstreamTimeout("worker did not finish its answer in time") from None
        except BROKEN_BODY as exc:
            raise UpstreamError(f"worker connection failed while reading: {exc}") from exc

    async def iter_chunks(self, sink: Sink | None = None) -> AsyncIterator[bytes]:
        """Yields body bytes as they arrive, never waiting to merge them.

        The first chunk may take as long as queueing plus prefill (`first_byte_s`); after it, a
        silence longer than `idle_s` ends the stream with UpstreamTimeout.

        With a `sink`, whenever it is ready (the consumer has started its answer and its client
        takes bytes), the body goes to the sink straight from the connection's read callback
        instead (`_Splice`), and only what the sink could not take is yielded.
        """
        content = self._response.content
        watchdog = _Watchdog(self._timeouts.first_byte_s, self._timeouts.idle_s)
        try:
            while chunk := await content.readany():
                watchdog.arrived()
                yield chunk
                watchdog.waiting()
                if sink is not None and sink.ready():
                    await _Splice.run(self._response, sink, watchdog)
        except asyncio.CancelledError:
            if watchdog.expire_cancel():
                raise UpstreamTimeout("worker stream went silent") from None
            raise
        except BROKEN_BODY as exc:
            raise UpstreamError(f"worker connection failed mid-stream: {exc}") from exc
        finally:
            watchdog.stop()

    def close(self) -> None:
        self._guard.stop()
        self._response.close()

    def release(self) -> None:
        self._guard.stop()
        self._response.release()


class Sink(Protocol):
    """Where a splice writes: the client's side of a streamed answer."""

    def ready(self) -> bool:
        """True when `write` may be called now (the client takes bytes without waiting)."""

    def write(self, data: bytes) -> None:
        """Sends `data` on, synchronously."""


class _Splice(asyncio.Protocol):
    """Stands in for aiohttp's protocol on a streaming answer's connection while the client
    keeps up: aiohttp still parses every read, and the body it produced goes to the sink in the
    same callback. A relayed event then costs no task switch, no async-generator step and no
    ASGI message (12-18% less CPU per event in all, benchmarks/results/stream_events.md).

    It hands back (aiohttp's protocol restored, `run` returns) as soon as the sink is not ready,
    the body ended or failed, or the connection went: the caller's `readany` loop deals with
    what is left exactly as without a splice, so backpressure, errors and the end of the body
    keep one implementation. Everything it uses is public: `transport.set_protocol` (asyncio)
    and `StreamReader.read_nowait`/`is_eof`/`exception` (aiohttp).
    """

    def __init__(
        self,
        inner: asyncio.Protocol,
        transport: asyncio.Transport,
        content: aiohttp.StreamReader,
        sink: Sink,
        watchdog: _Watchdog,
    ) -> None:
        self._inner = inner
        self._transport = transport
        self._content = content
        self._sink = sink
        self._watchdog = watchdog
        self._over: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @classmethod
    async def run(cls, response: aiohttp.ClientResponse, sink: Sink, watchdog: _Watchdog) -> None:
        connection = response.connection
        protocol = connection.protocol if connection is not None else None
        transport = protocol.transport if protocol is not None else None
        if protocol is None or transport is None or transport.is_closing():
            return
        splice = cls(protocol, transport, response.content, sink, watchdog)
        transport.set_protocol(splice)
        try:
            splice._pump()  # what aiohttp buffered before the splice began
            await splice._over
        finally:
            splice._hand_back()

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)
        self._pump()

    def eof_received(self) -> bool | None:
        keep_open = self._inner.eof_received()
        self._pump()
        return keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)
        self._hand_back()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def _pump(self) -> None:
        content = self._content
        if self._over.done():
            return
        if content.exception() is not None or not self._sink.ready():
            self._hand_back()
            return
        data = content.read_nowait()
        if data:
            self._watchdog.progress()
            self._sink.write(data)
        if content.is_eof():
            self._hand_back()

    def _hand_back(self) -> None:
        if self._over.done():
            return
        self._over.set_result(None)
        if not self._transport.is_closing():
            self._transport.set_protocol(self._inner)


# What reading a body may raise when the worker's answer breaks: aiohttp's own errors, and the
# pure-Python parser's (aiohttp without its C extension), which are not ClientErrors.
BROKEN_BODY = (aiohttp.ClientError, HttpProcessingError)


class _BodyGuard:
    """Fails a body's reader whose connection closed before the body ended.

    aiohttp's C parser closes the connection on a malformed chunk in a body but neither ends
    nor fails the body's reader: a read would wait for the stream's idle limit (two minutes by
    default) on an answer that is already broken (issue 14's garbage-answer fault test). One
    callback per response on the connection's `closed` future, taken off again when the
    response is closed (pooled connections outlive their responses), so nothing is added per
    chunk. `closed` is made on first use: whoever makes it must see its error (a reset) taken,
    or asyncio logs it as never retrieved; `watched` holds the futures that have their taker.
    """

    def __init__(
        self, response: aiohttp.ClientResponse, watched: weakref.WeakSet[asyncio.Future[None]]
    ) -> None:
        self._content = response.content
        connection = response.connection
        protocol = connection.protocol if connection is not None else None
        # `is not None`: a protocol with nothing buffered is falsy (it has a length).
        self._closed = protocol.closed if protocol is not None else None
        if self._closed is None:
            return
        if self._closed not in watched:
            watched.add(self._closed)
            self._closed.add_done_callback(_take_error)
        self._closed.add_done_callback(self._fail_unfinished)

    def _fail_unfinished(self, closed: asyncio.Future[None]) -> None:
        if not self._content.is_eof() and self._content.exception() is None:
            self._content.set_exception(aiohttp.ClientPayloadError("the answer broke off"))

    def stop(self) -> None:
        if self._closed is not None:
            self._closed.remove_done_callback(self._fail_unfinished)
            self._closed = None


def _take_error(closed: asyncio.Future[None]) -> None:
    if not closed.cancelled():
        closed.exception()


LARGE_BODY = 1024 * 1024


def _payload(body: bytes) -> bytes | io.BytesIO:
    # aiohttp writes a large bytes body in one go and warns it may hold the loop; a file-like
    # payload is written in chunks. Page images make multi-megabyte bodies common here.
    return io.BytesIO(body) if len(body) > LARGE_BODY else body


# vLLM's API server (uvicorn) closes a keep-alive connection after 5 s idle
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE). A pool that keeps connections longer reuses ones the worker is
# closing: the request then fails with "Server disconnected" or "Can not write request body",
# which counts towards ejecting a healthy worker (seen on real vLLM under load). Stay below it.
KEEPALIVE_S = 4.0


class UpstreamClient:
    """One pooled aiohttp session for every call to every worker; built in the app's lifespan."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None
        self._watched: weakref.WeakSet[asyncio.Future[None]] = weakref.WeakSet()

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # the gateway's admission control bounds concurrency, not the pool
            ttl_dns_cache=10,  # compose/Kubernetes service names may move
            keepalive_timeout=KEEPALIVE_S,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect_s),
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("UpstreamClient used before start()")
        return self._session

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """Sends a request and waits for the response headers.

        UpstreamConnectError means nothing reached the worker, so another may be tried.
        """
        try:
            async with asyncio.timeout(self.timeouts.first_byte_s):
                response = await self.session.post(url, data=_payload(body), headers=headers)
        except aiohttp.ConnectionTimeoutError as exc:  # a TimeoutError too: it must come first
            limit = self.timeouts.connect_s
            raise UpstreamConnectTimeout(f"no connection to {url} within {limit} s") from exc
        except TimeoutError:
            limit = self.timeouts.first_byte_s
            raise UpstreamTimeout(f"no response from worker within {limit} s") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamConnectError(f"cannot reach worker {url}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"worker request failed: {exc}") from exc
        return UpstreamResponse(response, self.timeouts, self._watched)

    async def get_json(self, url: str, timeout_s: float) -> Any:
        """GET a small JSON document (model lists, worker metrics)."""
        body = await self.get_ok(url, timeout_s)
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise UpstreamError(f"GET {url} did not answer JSON: {exc}") from exc

    async def get_ok(self, url: str, timeout_s: float) -> bytes:
        """GET `url`, expecting 200 (a worker's /health); returns the body."""
        try:
            async with asyncio.timeout(timeout_s), self.session.get(url) as response:
                body = await response.read()
        except TimeoutError:
            raise UpstreamTimeout(f"GET {url} took longer than {timeout_s} s") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamConnectError(f"cannot reach {url}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"GET {url} failed: {exc}") from exc
        if response.status != 200:
            raise UpstreamError(f"GET {url} answered {response.status}")
        return body
