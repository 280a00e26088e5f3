"""The gateway's HTTP server: an ASGI app served by the edge's protocol (api/connection.py) on
uvloop, stopping cleanly on SIGINT/SIGTERM.

- Startup: the app's ASGI lifespan starts, then the server listens (on host:port, or on sockets
  bound beforehand: `serve` and `up` bind theirs first), then what startup made is frozen out of
  the collector's way.
- A signal only asks the server to stop: services are expected to exit 0 on SIGTERM, and `up`
  must stop its workers after the gateway. Stopping: the listening sockets close, idle
  connections close, busy ones after their answer; requests get `graceful_timeout_s` to finish,
  then their tasks are cancelled; then the lifespan shuts down. A second signal skips the wait.
- A failed lifespan startup, or an address that cannot be bound, exits with status 3.

docs/http-edge.md says what the edge does with what clients send.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import structlog
import uvloop

from mineru_gateway.api.connection import App, Edge, GatewayHttpProtocol, Timeouts
from mineru_gateway.config import GatewaySettings

log = structlog.get_logger("mineru_gateway.server")

STARTUP_FAILURE = 3  # the exit status uvicorn gives the same failures
BACKLOG = 4096
TICK_S = 0.1  # how often the server looks whether it should stop
GC_YOUNG = 20_000  # allocations between collections of the youngest generation (`serve`)
CANCELLED_GRACE_S = 1.0  # for cancelled requests to end their answers (a 503, an SSE error)


def edge_timeouts(settings: GatewaySettings) -> Timeouts:
    """The edge's clocks from the gateway's settings."""
    return Timeouts(
        head_s=settings.head_timeout_s,
        body_idle_s=settings.body_idle_timeout_s,
        keep_alive_s=settings.keep_alive_timeout_s,
    )


class Lifespan:
    """The app's ASGI lifespan: started before the server listens, shut down after it drained.
    An app that returns at once has none."""

    def __init__(self, app: App) -> None:
        self._app = app
        self.state: dict[str, Any] = {}
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._started = asyncio.Event()
        self._stopped = asyncio.Event()
        self.failed = False
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> bool:
        """Whether the app started."""
        self._task = asyncio.get_running_loop().create_task(self._main())
        await self._inbox.put({"type": "lifespan.startup"})
        await self._started.wait()
        return not self.failed

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._stopped.wait()

    async def _main(self) -> None:
        scope = {
            "type": "lifespan",
            "asgi": {"version": "3.0", "spec_version": "2.0"},
            "state": self.state,
        }
        try:
            await self._app(scope, self._inbox.get, self._send)
        except BaseException as exc:
            if not self._started.is_set():
                self.failed = True
            log.error("lifespan_failed", exc_info=exc)
        finally:
            self._started.set()
            self._stopped.set()

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind.endswith(".failed"):
            log.error(kind.replace(".", "_"), message=message.get("message", ""))
        if kind.startswith("lifespan.startup"):
            self.failed = kind.endswith(".failed")
            self._started.set()
        else:
            self._stopped.set()


class Server:
    """`app` on host:port (or on sockets given to `serve`) until `should_exit`, which a
    SIGINT/SIGTERM sets (`on_signal` runs first); a second signal sets `force_exit`."""

    def __init__(
        self,
        app: App,
        host: str,
        port: int,
        *,
        timeouts: Timeouts | None = None,
        graceful_timeout_s: float | None = None,
    ) -> None:
        self.edge = Edge(app, timeouts)
        self.host, self.port = host, port
        self.graceful_timeout_s = graceful_timeout_s
        self.on_signal: Callable[[], None] | None = None
        self.started = False
        self.should_exit = False
        self.force_exit = False
        self.servers: list[asyncio.Server] = []

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        with self._signals():
            log.info("server_starting", pid=os.getpid())
            lifespan = Lifespan(self.edge.app)
            if not await lifespan.startup():
                log.error("startup_failed")
                sys.exit(STARTUP_FAILURE)
            self.edge.app_state = lifespan.state
            try:
                await self._listen(sockets)
            except OSError as error:
                log.error("cannot_listen", host=self.host, port=self.port, error=str(error))
                await lifespan.shutdown()
                sys.exit(STARTUP_FAILURE)
            # Everything alive now (modules, the app, its settings, pools and metrics) lives as
            # long as the process: moved out of the collector's generations, full collections
            # no longer walk it on every run (docs/proxy-costs.md).
            gc.collect()
            gc.freeze()
            # A young generation of GC_YOUNG objects, not 700: a request allocates hundreds of
            # containers, nearly all freed by reference counting before a collection would
            # look at them; collected every few requests, they were walked for nothing.
            gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
            self.started = True
            await self._until_exit()
            await self._drain(sockets)
            if not self.force_exit:
                await lifespan.shutdown()
            log.info("server_stopped", pid=os.getpid())

    async def _listen(self, sockets: list[socket.socket] | None) -> None:
        loop = asyncio.get_running_loop()
        edge = self.edge

        def protocol() -> GatewayHttpProtocol:
            return GatewayHttpProtocol(edge, loop)

        if sockets is None:
            self.servers = [
                await loop.create_server(protocol, self.host, self.port, backlog=BACKLOG)
            ]
        else:
            for sock in sockets:
                self.servers.append(await loop.create_server(protocol, sock=sock, backlog=BACKLOG))
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                log.info("server_listening", url=f"http://{host}:{port}")

    async def _until_exit(self) -> None:
        """Polls `should_exit`, which a signal handler or another thread sets; the `date`
        header changes on each new second."""
        second = int(time.time())
        while not self.should_exit:
            await asyncio.sleep(TICK_S)
            now = time.time()
            if int(now) != second:
                second = int(now)
                self.edge.set_date(now)

    async def _drain(self, sockets: list[socket.socket] | None) -> None:
        edge = self.edge
        log.info("server_stopping", connections=len(edge.connections))
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(edge.connections):
            connection.shutdown()
        try:
            async with asyncio.timeout(self.graceful_timeout_s):
                # Polled: connections end in asyncio's callbacks, force_exit comes from a signal.
                while (edge.connections or edge.tasks) and not self.force_exit:  # noqa: ASYNC110
                    await asyncio.sleep(TICK_S)
        except TimeoutError:
            log.warning("drain_timeout", cancelled=len(edge.tasks))
            for task in list(edge.tasks):
                task.cancel()
            if edge.tasks:
                await asyncio.wait(list(edge.tasks), timeout=CANCELLED_GRACE_S)
        for connection in list(edge.connections):
            connection.transport.close()

    @contextlib.contextmanager
    def _signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only: a server in another thread is told
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._request_exit)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def _request_exit(self) -> None:
        if self.on_signal is not None:
            self.on_signal()
        if self.should_exit:
            self.force_exit = True  # a second Ctrl-C skips the drain
        self.should_exit = True


def make_server(
    app: Any,
    host: str,
    port: int,
    *,
    graceful_timeout_s: float | None = None,
    timeouts: Timeouts | None = None,
) -> Server:
    """`graceful_timeout_s`: on shutdown, how long in-flight requests may take to finish (the
    listening socket closes at once); None waits for them all."""
    return Server(app, host, port, timeouts=timeouts, graceful_timeout_s=graceful_timeout_s)


def run(
    app: Any,
    host: str,
    port: int,
    *,
    graceful_timeout_s: float | None = None,
    on_signal: Callable[[], None] | None = None,
    sockets: list[socket.socket] | None = None,
    timeouts: Timeouts | None = None,
) -> None:
    """Serves `app` until SIGINT/SIGTERM, on uvloop; `on_signal` runs first (e.g. draining).
    `sockets`: already bound listening sockets to serve on, instead of binding host:port."""
    served = make_server(app, host, port, graceful_timeout_s=graceful_timeout_s, timeouts=timeouts)
    served.on_signal = on_signal
    run_async(lambda: served.serve(sockets))


def run_async(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs `main()` on uvloop."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
