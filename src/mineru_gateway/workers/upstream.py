"""The one seam for calls to workers, and the one place transport errors become GatewayErrors.

The transport is `workers.http1`, a lean HTTP/1.1 client over httptools: for the relay's small
requests aiohttp's client path costs more CPU than all the rest, and a plain httpx streaming
relay falls behind the offered SSE events (docs/proxy-costs.md, benchmarks/results/).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from mineru_gateway.errors import (
    UpstreamBadStatus,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from mineru_gateway.workers.http1 import (
    Answer,
    BadStatus,
    ConnectFailed,
    Deadline,
    Disconnected,
    Http1Pool,
    Malformed,
)

__all__ = ["KEEPALIVE_S", "Chunks", "Timeouts", "UpstreamClient", "UpstreamResponse"]


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float
    first_byte_s: float
    idle_s: float


class _Watchdog:
    """A deadline on the worker's silence, at the cost of one clock read per chunk.

    Only the time spent waiting on the worker counts (from `waiting()` to the next
    `arrived()`): while the relay is held up by a slow client, backpressure keeps the worker
    from sending, and that is not its silence (the slow-reader fault test: a stream read slower
    than the idle limit must not be cut, nor the cut taken for a client disconnect). The timer
    fires only while waiting, so its cancellation always lands in the worker read that
    `Chunks` turns into UpstreamTimeout.

    `asyncio.timeout(...).reschedule()` per chunk would cost a timer handle each time; this
    timer is re-armed only when it fires (docs/proxy-costs.md).
    """

    def __init__(self, first_s: float, idle_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._idle = idle_s
        self._last = time.perf_counter()
        self._limit = first_s
        self._waiting = True
        self._fired = False
        self._handle = self._loop.call_later(first_s, self._check)

    def waiting(self) -> None:
        """The relay asks the worker for the next chunk."""
        self._last = time.perf_counter()
        self._waiting = True

    def arrived(self) -> None:
        """A chunk came: the relay holds it until the client has taken it."""
        self._waiting = False
        if self._limit != self._idle:  # the first chunk: from now on, the idle limit
            self._limit = self._idle
            self._handle.cancel()
            self._handle = self._loop.call_later(self._idle, self._check)

    def _check(self) -> None:
        now = time.perf_counter()
        deadline = self._last + self._limit
        if self._waiting and now >= deadline:
            self._fired = True
            self._task.cancel()
        else:  # held by the client, the deadline is a whole limit after it asks again
            delay = deadline - now if self._waiting else self._limit
            self._handle = self._loop.call_later(delay, self._check)

    def expire_cancel(self) -> bool:
        """True (and the cancellation withdrawn) if the cancellation was this deadline's."""
        return self._fired and self._task.uncancel() == 0

    def stop(self) -> None:
        self._handle.cancel()


class UpstreamResponse:
    """A worker's answer whose headers have arrived; the body is read or streamed on demand.

    `close()` drops the connection unless the answer has ended: that is how a worker learns
    that nobody waits for the answer any more, and vLLM then aborts the generation.
    """

    __slots__ = ("_answer", "_chunks", "_timeouts", "content_type", "status")

    def __init__(self, answer: Answer, timeouts: Timeouts) -> None:
        self._answer = answer
        self._timeouts = timeouts
        self._chunks: Chunks | None = None
        self.status = answer.status
        self.content_type = answer.content_type

    @property
    def is_event_stream(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    async def read(self) -> bytes:
        whole = self._answer.whole()
        if whole is not None:
            return whole  # a small answer usually arrives with its headers: no timer needed
        try:
            with Deadline(self._timeouts.first_byte_s):
                return await self._answer.read()
        except TimeoutError:
            raise UpstreamTimeout("worker did not finish its answer in time") from None
        except BROKEN_BODY as exc:
            raise UpstreamError(f"worker connection failed while reading: {exc}") from exc

    def iter_chunks(self) -> Chunks:
        """The body as it arrives, for `async for` (`Chunks`)."""
        self._chunks = Chunks(self._answer, self._timeouts)
        return self._chunks

    def close(self) -> None:
        if self._chunks is not None:
            self._chunks.stop()
        self._answer.close()


class Chunks:
    """A streamed body's bytes as they arrive (`async for`), never waiting to merge them.

    The first chunk may take as long as queueing plus prefill (`first_byte_s`); after it, a
    silence longer than `idle_s` ends the stream with UpstreamTimeout. The watchdog stops at
    the end, at an error, or when the response is closed (`UpstreamResponse.close`), whichever
    comes first.
    """

    __slots__ = ("_answer", "_timeouts", "_watchdog")

    def __init__(self, answer: Answer, timeouts: Timeouts) -> None:
        self._answer = answer
        self._timeouts = timeouts
        self._watchdog: _Watchdog | None = None

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> bytes:
        watchdog = self._watchdog
        first = watchdog is None
        if watchdog is None:  # the first chunk, in the task that reads them
            watchdog = self._watchdog = _Watchdog(
                self._timeouts.first_byte_s, self._timeouts.idle_s
            )
        try:
            if not first:  # the consumer has taken the last chunk
                watchdog.waiting()
            chunk = await self._answer.read_some()
        except asyncio.CancelledError:
            watchdog.stop()
            if watchdog.expire_cancel():
                raise UpstreamTimeout("worker stream went silent") from None
            raise
        except BROKEN_BODY as exc:
            watchdog.stop()
            raise UpstreamError(f"worker connection failed mid-stream: {exc}") from exc
        except BaseException:
            watchdog.stop()
            raise
        if not chunk:
            watchdog.stop()
            raise StopAsyncIteration
        watchdog.arrived()
        return chunk

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()


# What reading an answer may raise when it breaks.
BROKEN_BODY = (Disconnected, Malformed)


# vLLM's API server (uvicorn) closes a keep-alive connection after 5 s idle
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE). A pool that keeps connections longer reuses ones the worker is
# closing: the request then fails with "Server disconnected" or "Can not write request body",
# which counts towards ejecting a healthy worker (seen on real vLLM under load). Stay below it.
KEEPALIVE_S = 4.0


class UpstreamClient:
    """One pool of keep-alive connections for every call to every worker; started in the app's
    lifespan."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._pool: Http1Pool | None = None

    async def start(self) -> None:
        # No limit on connections: the gateway's admission control bounds concurrency.
        self._pool = Http1Pool(self.timeouts.connect_s, KEEPALIVE_S)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def pool(self) -> Http1Pool:
        if self._pool is None:
            raise RuntimeError("UpstreamClient used before start()")
        return self._pool

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """Sends a request and waits for the response headers.

        UpstreamConnectError means nothing reached the worker, so another may be tried;
        UpstreamBadStatus, that the worker's answer has a status no client may be given.
        """
        try:
            answer = await self.pool.request("POST", url, headers, body, self.timeouts.first_byte_s)
        except ConnectFailed as failed:
            if failed.timed_out:
                raise UpstreamConnectTimeout(str(failed)) from None
            raise UpstreamConnectError(f"cannot reach worker {url}: {failed}") from None
        except TimeoutError:
            limit = self.timeouts.first_byte_s
            raise UpstreamTimeout(f"no response from worker within {limit} s") from None
        except BadStatus as bad:
            raise UpstreamBadStatus(f"worker {url} answered status {bad.status}") from None
        except BROKEN_BODY as exc:
            raise UpstreamError(f"worker request failed: {exc}") from exc
        return UpstreamResponse(answer, self.timeouts)

    async def get_json(self, url: str, timeout_s: float) -> Any:
        """GET a small JSON document (model lists, worker metrics)."""
        body = await self.get_ok(url, timeout_s)
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise UpstreamError(f"GET {url} did not answer JSON: {exc}") from exc

    async def get_ok(self, url: str, timeout_s: float) -> bytes:
        """GET `url`, expecting 200 (a worker's /health, its load series); returns the body.

        One deadline for the whole GET: the pool's for the headers, and for a body that did not
        come with them (it usually does), what is left of it. These GETs run ten times a second
        with two workers, and a second timer around every one would be idle work."""
        started = time.monotonic()
        try:
            answer = await self.pool.request("GET", url, {}, b"", timeout_s)
            try:
                body = answer.whole()
                if body is None:
                    with Deadline(started + timeout_s - time.monotonic()):
                        body = await answer.read()
            finally:
                answer.close()
        except TimeoutError:
            raise UpstreamTimeout(f"GET {url} took longer than {timeout_s} s") from None
        except ConnectFailed as failed:
            raise UpstreamConnectError(f"cannot reach {url}: {failed}") from None
        except BROKEN_BODY as exc:
            raise UpstreamError(f"GET {url} failed: {exc}") from exc
        if answer.status != 200:
            raise UpstreamStatusError(f"GET {url} answered {answer.status}")
        return body
