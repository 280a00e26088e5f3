"""Listeners besides the client port, on the gateway's own event loop, started and stopped by
the app's lifespan. They install no signal handlers: the main server's handle SIGTERM, and these
stop when the lifespan ends.

- `/metrics` on a port of its own (issue 14): with `METRICS_PORT` set, the client port no longer
  serves it, so tenants cannot read each other's request counts and the operator can bind it to
  an internal interface (or a port only Prometheus reaches).
- The whole gateway on a private Unix socket, for the other processes when there are several
  (siblings.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Generator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST

from mineru_gateway.siblings import SIBLING_SCOPE_KEY

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


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


def sibling_view(app: ASGIApp, state: Mapping[str, Any]) -> ASGIApp:
    """`app` as the other processes reach it: every request marked as a sibling's, with the
    app's lifespan state (this listener runs no lifespan of its own)."""

    async def view(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        scope = {**scope, "state": dict(state), SIBLING_SCOPE_KEY: True}
        await app(scope, receive, send)

    return view


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the main one."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Listener:
    """`app` served on `host:port` (with SO_REUSEPORT when several processes share it) or on
    the Unix socket `uds`."""

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        uds: Path | None = None,
        reuse_port: bool = False,
    ) -> None:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            uds=str(uds) if uds is not None else None,
            lifespan="off",
            log_level="warning",
            access_log=False,
            proxy_headers=False,  # nothing here reads the client's address
        )
        self._server = _QuietServer(config)
        self._reuse_port = reuse_port
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Returns once it listens; raises OSError when the port is taken."""
        sockets = None
        if self._reuse_port:
            config = self._server.config
            sockets = [reuse_port_socket(config.host, config.port)]
        self._task = asyncio.create_task(self._serve(sockets), name="listener")
        while not self._server.started:  # uvicorn only exposes a flag
            if self._task.done():
                config = self._server.config
                where = config.uds or f"{config.host}:{config.port}"
                raise OSError(f"the listener could not listen on {where}")
            await asyncio.sleep(0.01)

    async def _serve(self, sockets: list[socket.socket] | None) -> None:
        # uvicorn logs why and calls sys.exit when it cannot bind: that must not end the
        # gateway's event loop from inside a task.
        with contextlib.suppress(SystemExit):
            await self._server.serve(sockets)

    @property
    def port(self) -> int:
        sockets = [sock for server in self._server.servers for sock in server.sockets]
        return int(sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT: the kernel spreads new connections
    over every process listening so (Linux)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
