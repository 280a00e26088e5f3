"""The client's connection, as the relay sees it under the gateway's own server protocol.

ASGI gives an app two things per request, `receive` and `send`, and the relay pays for both on
every request (py-spy and an ablation on small non-streaming requests,
benchmarks/results/small_requests.md):

- Learning that the client went away needs a task parked in `receive()` for the whole
  exchange: a task, an event and two wake-ups per request, about 15% of a small request's CPU.
- A whole answer takes two `send` messages, and uvicorn writes its head and its body in two
  `write` system calls.
- A stream's body takes an ASGI message, a task switch and an async-generator step per event.

`GatewayHttpProtocol` is uvicorn's httptools protocol (keep-alive, pipelining, flow control,
limits and graceful shutdown stay uvicorn's) that also hands each request a `ClientLink` in
its scope's extensions. Through it the relay registers a callback for the connection's loss
(called from `connection_lost`, no task), writes a whole answer's head and body in one write, and
writes a started stream's body straight to the transport (`DirectSink`). The ends of answers
keep uvicorn's bookkeeping: the link sets the same fields uvicorn's `send` does and calls its
completion callback, so keep-alive and the next pipelined request carry on as after any answer.

The link reads and sets attributes of uvicorn's `RequestResponseCycle` (the ones its `send` and
`receive` use); a server without the link (uvicorn's h11 or httptools protocols, another ASGI
server, a test client) gets the plain ASGI path. tests/api/test_connection.py fails if the
gateway's server stops making links or an uvicorn release changes what the link relies on.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, MutableMapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

EXTENSION = "mineru_gateway.client"
# uvicorn's own check of header values: no control characters but tab.
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")


class ClientLink:
    """One request's side of the client connection, below ASGI."""

    __slots__ = ("_answered", "_cycle", "_gone", "_on_lost")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._answered = False  # the answer was complete when the cycle was let go
        self._gone = False
        self._on_lost: Callable[[], None] | None = None

    @staticmethod
    def of(scope: MutableMapping[str, Any]) -> ClientLink | None:
        """The link the gateway's protocol put in `scope`, or None under any other server."""
        extensions = scope.get("extensions")
        return extensions.get(EXTENSION) if extensions else None

    @property
    def done(self) -> bool:
        """The answer is complete or can no longer be given."""
        return self._cycle is None or _over(self._cycle)

    def detach(self) -> None:
        """Lets go of the request cycle, once its answer is over (called by the protocol).

        The cycle's scope holds the link and the link held the cycle: a reference cycle per
        request that only the cyclic garbage collector could free, and its collections cost
        more than the link saved (benchmarks/results/small_requests.md).
        """
        if self._cycle is not None:
            self._answered = bool(self._cycle.response_complete)
            self._cycle = None

    def on_lost(self, callback: Callable[[], None] | None) -> None:
        """`callback` runs once if the connection is lost before the answer is complete (at
        once if it already is); None forgets it."""
        self._on_lost = callback
        if self._gone:
            self.lost()

    def lost(self) -> None:
        """The connection is gone (called by the protocol)."""
        self._gone = True
        callback, self._on_lost = self._on_lost, None
        cycle = self._cycle
        answered = self._answered if cycle is None else cycle.response_complete
        if callback is not None and not answered:
            callback()

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole answer, sized, in one write: what uvicorn's `send` does for a start and a
        last body message, without the two messages and the second write. Nothing is written
        to a connection that is gone, as with uvicorn's `send`."""
        cycle = self._cycle
        if cycle is None:
            return
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return
        if cycle.response_started:
            raise RuntimeError("the answer has already started")
        content = [STATUS_LINE[status]]
        for name, value in cycle.default_headers:
            content += (name, b": ", value, b"\r\n")
        for name, value in headers:
            if _BAD_VALUE.search(value):
                raise RuntimeError(f"invalid value of header {name!r}")
            content += (name, b": ", value, b"\r\n")
        content += (b"content-length: %d\r\n" % len(body),)
        if not cycle.keep_alive:
            content += (b"connection: close\r\n",)
        content += (b"\r\n", body)
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.chunked_encoding = False
        cycle.transport.write(b"".join(content))
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()

    def sink(self, note: Callable[[bytes], float]) -> DirectSink | None:
        """Where a stream's body may be written once its answer has started through `send`;
        None once the connection is gone."""
        return None if self._cycle is None else DirectSink(self._cycle, note)


def _over(cycle: Any) -> bool:
    """uvicorn's request cycle has its whole answer, or its connection is gone."""
    return bool(cycle.response_complete or cycle.disconnected)


class DirectSink:
    """The client's side of one streamed answer, written without ASGI messages: each body chunk
    in uvicorn's chunked framing, straight to the transport, from the worker connection's read
    callback (`workers/http1.py`, `Answer.splice`). The answer's end still goes through `send`.

    `note(data)` does the relay's bookkeeping for a chunk and returns its time (perf_counter)."""

    __slots__ = ("_cycle", "_flow", "_note", "_transport", "last_write", "used")

    def __init__(self, cycle: Any, note: Callable[[bytes], float]) -> None:
        self.used = False  # anything written here
        self.last_write = 0.0
        self._cycle = cycle
        self._transport: asyncio.Transport = cycle.transport
        self._flow = cycle.flow
        self._note = note

    def ready(self) -> bool:
        """The answer has started in chunked framing and the client takes bytes now."""
        cycle = self._cycle
        return cycle.chunked_encoding is True and not _over(cycle) and self._takes_bytes()

    def offer(self, data: bytes) -> bool:
        """Once per relayed event. While a splice runs, its answer has started and is not over
        (only the relay ends it, after the splice), so only the client's side can change: gone
        (its transport closing) or not taking bytes (writing paused)."""
        if not self._takes_bytes():
            return False
        self.used = True
        self.last_write = self._note(data)
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    def _takes_bytes(self) -> bool:
        return not (self._flow.write_paused or self._transport.is_closing())


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, handing each request a `ClientLink` (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._links: list[ClientLink] = []  # the requests of this connection not yet answered

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return  # an upgrade: no request cycle of ours
        link = ClientLink(cycle)
        self._links.append(link)
        scope: Any = self.scope  # uvicorn types extension values as dicts; ours is the link
        extensions = scope.get("extensions")
        if extensions is None:
            scope["extensions"] = {EXTENSION: link}
        else:
            extensions[EXTENSION] = link

    def on_response_complete(self) -> None:
        if self._links:
            waiting = []
            for link in self._links:
                if link.done:
                    link.detach()
                else:
                    waiting.append(link)  # a pipelined request not yet answered
            self._links = waiting
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        links, self._links = self._links, []
        for link in links:
            link.lost()
            link.detach()
