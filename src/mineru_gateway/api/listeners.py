"""Listeners besides the client port, on the gateway's own event loop and its own HTTP/1.1
server protocol (api/connection.py), started and stopped by the app's lifespan. They install no
signal handlers and run no lifespan: the main server handles SIGTERM, and these stop when the
lifespan ends.

- `/metrics` on a port of its own: with `METRICS_PORT` set, the client port no longer serves it,
  so tenants cannot read each other's request counts and the operator can bind it to an
  internal interface (or a port only Prometheus reaches).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from mineru_gateway.api.connection import Edge, GatewayHttpProtocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

STOP_GRACE_S = 5.0  # for answers under way when the listener stops


def metrics_app(render: Callable[[], Awaitable[bytes]]) -> ASGIApp:
    """GET /metrics answers `await render()`; everything else is 404."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            status, body, kind = 200, await render(), CONTENT_TYPE_LATEST.encode()
        else:
            status, body, kind = (
                404,
                b"not found: this listener serves GET /metrics\n",
                b"text/plain",
            )
        headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": body if scope["method"] != "HEAD" else b""}
        )

    return app


class Listener:
    """`app` served on `host:port` by the gateway's server protocol."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self._port = host, port
        self.edge = Edge(app)
        self._server: asyncio.Server | None = None
        self._clock: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        """Returns once it listens; raises OSError when the port is taken."""
        loop = asyncio.get_running_loop()
        edge = self.edge
        try:
            self._server = await loop.create_server(
                lambda: GatewayHttpProtocol(edge, loop), self.host, self._port
            )
        except OSError as error:
            where = f"{self.host}:{self._port}"
            why = error.strerror or str(error)
            raise OSError(error.errno, f"the listener could not listen on {where}: {why}") from None
        self._tick()

    def _tick(self) -> None:
        """The `date` header, once a second (as the main server sets it: entry/server.py)."""
        now = time.time()
        self.edge.set_date(now)
        loop = asyncio.get_running_loop()
        self._clock = loop.call_later(1.0 - now % 1.0, self._tick)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stops listening; idle connections close now, busy ones after their answer (within
        STOP_GRACE_S)."""
        if self._server is None:
            return
        server, self._server = self._server, None
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None
        server.close()
        edge = self.edge
        for connection in list(edge.connections):
            connection.shutdown()
        if edge.tasks:
            await asyncio.wait(list(edge.tasks), timeout=STOP_GRACE_S)
        for connection in list(edge.connections):
            connection.transport.close()
        await server.wait_closed()
