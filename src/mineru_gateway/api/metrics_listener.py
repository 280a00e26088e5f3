"""`/metrics` on a listener of its own (issue 14): with `METRICS_PORT` set, the client port no
longer serves it, so tenants cannot read each other's request counts and the operator can bind
it to an internal interface (or a port only Prometheus reaches).

It is a second uvicorn server on the gateway's own event loop, started and stopped by the app's
lifespan, rendering the same registry. It installs no signal handlers: the main server's handle
SIGTERM, and this one stops when the lifespan ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Generator, MutableMapping
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def metrics_app(registry: CollectorRegistry) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """GET /metrics renders `registry`; everything else is 404."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            status, body, kind = 200, generate_latest(registry), CONTENT_TYPE_LATEST.encode()
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


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the main one."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class MetricsListener:
    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        config = uvicorn.Config(
            metrics_app(registry),
            host=host,
            port=port,
            lifespan="off",
            log_level="warning",
            access_log=False,
        )
        self._server = _QuietServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Returns once it listens; raises OSError when the port is taken."""
        self._task = asyncio.create_task(self._serve(), name="metrics-listener")
        while not self._server.started:  # uvicorn only exposes a flag
            if self._task.done():
                config = self._server.config
                raise OSError(
                    f"the metrics listener could not listen on {config.host}:{config.port}"
                )
            await asyncio.sleep(0.01)

    async def _serve(self) -> None:
        # uvicorn logs why and calls sys.exit when it cannot bind: that must not end the
        # gateway's event loop from inside a task.
        with contextlib.suppress(SystemExit):
            await self._server.serve()

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
