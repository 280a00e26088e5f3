"""Writing a stream's body to the client's connection directly, below ASGI.

Per relayed SSE event, the ASGI path costs a task switch, an async-generator step and an ASGI
message through uvicorn's `send`, most of the relay's own Python per event (py-spy; skipping
them saved 12-18% of the gateway's CPU per event, benchmarks/results/stream_events.md). Once a
stream's answer has started through `send` (status, headers, chunked framing chosen by uvicorn),
`DirectSink` writes each body chunk in uvicorn's own chunked framing straight to the
connection's transport, from the upstream connection's read callback (`workers.upstream`'s
splice). The answer's end still goes through `send`, so uvicorn's keep-alive and
response-completion logic run as always.

This reads uvicorn internals (`RequestResponseCycle.transport`, `.flow`, `.chunked_encoding`
of the httptools protocol), so it is used only where they are exactly as expected:
`DirectSink.attach` returns None for any other server or protocol (h11, granian, a test
client), and the relay then writes through `send` as before. A test asserts that the gateway
under its own server does take this path, so an uvicorn release that changes them fails the
tests instead of silently costing twice the CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

HTTPTOOLS_CYCLE = "uvicorn.protocols.http.httptools_impl"


class DirectSink:
    """The client's side of one streamed answer, written without ASGI messages."""

    __slots__ = ("_cycle", "_flow", "_note", "_transport", "used")

    def __init__(self, cycle: Any, note: Callable[[bytes], None]) -> None:
        self.used = False  # anything written here
        self._cycle = cycle
        self._transport: asyncio.Transport = cycle.transport
        self._flow = cycle.flow
        self._note = note

    @classmethod
    def attach(cls, send: Callable[..., Any], note: Callable[[bytes], None]) -> DirectSink | None:
        """A sink for the answer `send` writes, or None where the server is not uvicorn's
        httptools protocol. `note` sees every chunk written (the relay's bookkeeping)."""
        cycle = getattr(send, "__self__", None)
        if cycle is None or type(cycle).__module__ != HTTPTOOLS_CYCLE:
            return None
        if not all(hasattr(cycle, name) for name in ("transport", "flow", "chunked_encoding")):
            return None
        return cls(cycle, note)

    def ready(self) -> bool:
        """The answer has started in chunked framing and the client takes bytes now."""
        cycle = self._cycle
        return (
            cycle.chunked_encoding is True
            and not cycle.response_complete
            and not cycle.disconnected
            and not self._flow.write_paused
            and not self._transport.is_closing()
        )

    def write(self, data: bytes) -> None:
        self.used = True
        self._note(data)
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
