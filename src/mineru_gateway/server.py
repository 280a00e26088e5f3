"""Running an ASGI app on uvicorn (uvloop + httptools), stopping cleanly on SIGINT/SIGTERM.

uvicorn re-raises the signal it caught once it has shut down, so a stopped server would exit with
the signal's status. Services are expected to exit 0 on SIGTERM (issue 4), and `up` must stop its
workers after the gateway, so signals here only ask the server to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import uvicorn
import uvloop


class Server(uvicorn.Server):
    """A uvicorn server whose signal handling only requests shutdown."""

    on_signal: Callable[[], None] | None = None

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
        self.should_exit = True


def make_server(app: Any, host: str, port: int, log_level: str) -> Server:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level=log_level,
        access_log=False,  # the gateway logs each request itself, with its request id
        backlog=4096,
        timeout_keep_alive=30,
    )
    return Server(config)


def run(app: Any, host: str, port: int, log_level: str) -> None:
    """Serves `app` until SIGINT/SIGTERM, on uvloop."""
    make_server(app, host, port, log_level).run()


def run_async(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs `main()` on the event loop uvicorn would use (uvloop)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
