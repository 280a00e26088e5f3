"""Running an ASGI app on uvicorn (uvloop + httptools), stopping cleanly on SIGINT/SIGTERM.

uvicorn re-raises the signal it caught once it has shut down, so a stopped server would exit with
the signal's status. Services are expected to exit 0 on SIGTERM (issue 4), and `up` must stop its
workers after the gateway, so signals here only ask the server to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import uvicorn
import uvloop

from mineru_gateway.api.connection import GatewayHttpProtocol


class Server(uvicorn.Server):
    """A uvicorn server whose signal handling only requests shutdown, and which freezes what
    its startup made once it is listening."""

    on_signal: Callable[[], None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # Everything alive now (modules, the app, its settings, pools and metrics) lives as
        # long as the process: moved out of the collector's generations, full collections no
        # longer walk it on every run. 6% of a small request's CPU (docs/proxy-costs.md).
        gc.collect()
        gc.freeze()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
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
            self.force_exit = True  # a second Ctrl-C skips the drain, as uvicorn's own does
        self.should_exit = True


def make_server(
    app: Any, host: str, port: int, log_level: str, graceful_timeout_s: float | None = None
) -> Server:
    """`graceful_timeout_s`: on shutdown, how long in-flight requests may take to finish (the
    listening socket closes at once); None waits for them all."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=GatewayHttpProtocol,  # the gateway's own, with the relay's link (api/connection.py)
        lifespan="on",
        log_level=log_level,
        access_log=False,  # the gateway logs each request itself, with its request id
        # Nothing in the gateway reads the client's address: rewriting it from X-Forwarded-For
        # was a middleware hop and a header scan per request for nothing.
        proxy_headers=False,
        backlog=4096,
        timeout_keep_alive=30,
        # uvicorn annotates int, but only hands the value to asyncio.wait_for: a float works.
        timeout_graceful_shutdown=graceful_timeout_s,  # type: ignore[arg-type]
    )
    return Server(config)


def run(
    app: Any,
    host: str,
    port: int,
    log_level: str,
    *,
    graceful_timeout_s: float | None = None,
    on_signal: Callable[[], None] | None = None,
    sockets: list[socket.socket] | None = None,
) -> None:
    """Serves `app` until SIGINT/SIGTERM, on uvloop; `on_signal` runs first (e.g. draining).
    `sockets`: already bound listening sockets to serve on, instead of binding host:port."""
    served = make_server(app, host, port, log_level, graceful_timeout_s)
    served.on_signal = on_signal
    served.run(sockets)


def run_async(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs `main()` on the event loop uvicorn would use (uvloop)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
