"""One answer to a client: its writer (`ClientAnswer`) and its clock and tokens (`AnswerClock`).

The relay writes a worker's answer to a sink (`cache.service.Sink`): the client's writer here,
or one the result cache puts in its place (an answer held for every client that shares it, or
one labelled with its `X-Cache` header). The clock is the answer's, whichever sink wrote it:
when it went upstream, its first and last chunk, its end, its tokens and usage, read by the
exchange's accounting (api/relay.py) when it is over.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from mineru_gateway.api.connection import ClientLink
from mineru_gateway.errors import GatewayError
from mineru_gateway.metrics import Series
from mineru_gateway.request import Endpoint

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

# One streamed token, as vLLM writes it: a chat delta with content, or a completion's text.
TOKEN_MARKERS: dict[Endpoint, bytes] = {"chat": b'{"content":', "completions": b'"text":'}
USAGE_MARKER = b'"usage":{'


class AnswerClock:
    """When the answer moved, how many tokens it carried, and its usage."""

    __slots__ = (
        "_itl",
        "_last",
        "_marker",
        "_tail",
        "finished",
        "first_chunk",
        "last_chunk",
        "received",
        "tokens",
        "upstream_sent",
        "usage",
    )

    def __init__(self, endpoint: Endpoint) -> None:
        self.received = time.perf_counter()
        self.upstream_sent: float | None = None
        self.first_chunk: float | None = None
        self.last_chunk = 0.0
        self.finished: float | None = None
        self.tokens = 0  # counted from the stream
        self._marker = TOKEN_MARKERS[endpoint]
        # A stream's last two chunks: vLLM's usage event is the last before [DONE], read from
        # them once the stream is over (`stream_usage`) rather than looked for in every event.
        self._tail = self._last = b""
        self.usage: dict[str, Any] | None = None  # a whole answer's
        self._itl: Series | None = None

    def note(self, data: bytes) -> None:
        """Bookkeeping for a body chunk going out, once per relayed event: timing, tokens, the
        chunk kept as one of the last two."""
        now = time.perf_counter()
        if self.first_chunk is None:
            self.first_chunk = now
        elif self._itl is not None:
            self._itl.observe(now - self.last_chunk)
        self.last_chunk = now
        self.tokens += data.count(self._marker)
        self._tail, self._last = self._last, data

    def measure_gaps(self, series: Series) -> None:
        """From now on, every gap between chunks goes to `series` (inter-token latency)."""
        self._itl = series

    def answer_usage(self) -> dict[str, Any] | None:
        """The whole answer's usage, or that of a stream's last usage event (vLLM's, before
        [DONE]) if one of its last two chunks carries one."""
        return self.usage or stream_usage(self._last) or stream_usage(self._tail)


class ClientAnswer:
    """Writes the answer to the client: a head then chunks, or a whole answer; a failure the only
    way still open. In one write where the client's connection has a link (api/connection.py)."""

    __slots__ = (
        "_clock",
        "_last",
        "_link",
        "_request_id",
        "_send",
        "complete",
        "status",
        "streaming",
    )

    def __init__(
        self, send: Send, request_id: str, clock: AnswerClock, link: ClientLink | None = None
    ) -> None:
        self._send = send
        self._link = link
        self._request_id = request_id.encode("latin-1")
        self._clock = clock
        self._last = b""  # the last chunk: whether a stream's end falls inside an event
        self.status: int | None = None
        self.streaming = False
        self.complete = False

    async def start(self, status: int, content_type: str, extra: Headers | None = None) -> None:
        headers = self._started(status, content_type, extra)
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    def _started(self, status: int, content_type: str, extra: Headers | None) -> Headers:
        """Notes the answer's start; its headers."""
        self.status = status
        self.streaming = content_type.startswith("text/event-stream")
        headers = [
            (b"content-type", content_type.encode("latin-1")),
            (b"x-request-id", self._request_id),
        ]
        if extra:
            headers.extend(extra)
        return headers

    async def chunk(self, data: bytes) -> None:
        self._last = data
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, data: bytes = b"") -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": False})
        self.complete = True
        self._clock.finished = time.perf_counter()

    async def respond(
        self, status: int, content_type: str, body: bytes, extra: Headers | None = None
    ) -> None:
        """A whole answer, sized (not in chunked framing)."""
        if self._link is None:
            length = [(b"content-length", b"%d" % len(body))]
            await self.start(status, content_type, length + extra if extra else length)
            await self.finish(body)
            return
        await self._link.respond(status, self._started(status, content_type, extra), body)
        self.complete = True
        self._clock.finished = time.perf_counter()

    async def fail(self, error: GatewayError) -> None:
        """Reports `error`: a JSON error before the head went out, an SSE error event (vLLM's
        own mid-stream form) after it."""
        if self.complete:
            return
        if self.status is None:
            body = error.body_bytes()
            await self.respond(error.status, "application/json", body, error.headers())
        elif self.streaming:
            event = b"data: " + error.body_bytes() + b"\n\ndata: [DONE]\n\n"
            if self._last and not self._last.endswith(b"\n\n"):
                # What went out ends inside an event: end it first, or the error would be read
                # as the rest of that event's data.
                event = b"\n\n" + event
            await self.finish(event)
        else:
            await self.finish()


def body_usage(body: bytes) -> dict[str, Any] | None:
    try:
        usage = orjson.loads(body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def stream_usage(data: bytes) -> dict[str, Any] | None:
    """The usage object of the last SSE event in `data` that carries one."""
    if data.find(USAGE_MARKER) < 0:  # not `in`: bytes' `in` tries an int first and fails
        return None
    for event in reversed(data.split(b"\n\n")):
        if event.startswith(b"data: ") and event.find(USAGE_MARKER) >= 0:
            usage = body_usage(event[6:])
            if usage is not None:
                return usage
    return None
